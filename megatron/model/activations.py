"""MLP activations, chosen by the config string ``activation``: one registry entry per activation.

A gated activation takes the first projection's output as ``[gate; up]`` along the last dim (each half
``ffn_hidden_size`` wide, or its tp shard) and returns ``fn(gate) * up``; being gated is what an entry
tells the parameter count (the MLP's first projection is twice as wide, ``mlp_width.py``). An activation
has no parameters, and its elementwise FLOPs are not counted for MFU (as for every layer). No torch
import: an entry's function is looked up when the MLP is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.model.option_registry import OptionRegistry

if TYPE_CHECKING:
    import torch

Fn = Callable[["torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class Activation:
    """The built activation: ``fn``, applied to the gate half times the other half when ``gated``."""

    fn: Fn
    gated: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fn(x)
        gate, up = x.chunk(2, dim=-1)
        return self.fn(gate) * up


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationEntry:
    """One ``activation`` value: ``function`` names torch's (``torch.nn.functional`` or ``torch``)."""

    function: str
    gated: bool = False
    approximate: str | None = None
    """GELU's ``approximate`` argument (``tanh``)."""

    def build(self) -> Activation:
        # lazy: torch; the launcher (deepy.py) reads this module without it
        import torch
        import torch.nn.functional as F

        if self.function == "identity":
            fn: Fn = _identity
        else:
            base: Callable[..., torch.Tensor] = getattr(F, self.function, None) or getattr(torch, self.function)
            fn = base if self.approximate is None else functools.partial(base, approximate=self.approximate)
        return Activation(fn, self.gated)

    @staticmethod
    def parameters() -> int:
        return 0

    @staticmethod
    def flops_per_token() -> float:
        return 0.0  # elementwise: not counted for MFU


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS: OptionRegistry[ActivationEntry] = OptionRegistry("activation")
for _name, _entry in {
    "gelu": ActivationEntry(function="gelu"),
    # GPT-2's "gelu_new" (Levanter's gpt2 default): the tanh approximation of GELU
    "gelu_tanh": ActivationEntry(function="gelu", approximate="tanh"),
    "relu": ActivationEntry(function="relu"),
    "silu": ActivationEntry(function="silu"),
    "swish": ActivationEntry(function="silu"),
    "softsign": ActivationEntry(function="softsign"),
    "mish": ActivationEntry(function="mish"),
    "geglu": ActivationEntry(function="gelu", gated=True),
    # Gemma's gelu_pytorch_tanh gated MLP (transformers 5.23.0 models/gemma2/modeling_gemma2.py:77-80; Levanter's
    # gelu_new, gemma.py:78@9263f81e): act(gate) * up with the tanh approximation of GELU
    "geglu_tanh": ActivationEntry(function="gelu", gated=True, approximate="tanh"),
    "reglu": ActivationEntry(function="relu", gated=True),
    "swiglu": ActivationEntry(function="silu", gated=True),
    "bilinear": ActivationEntry(function="identity", gated=True),
    "glu": ActivationEntry(function="sigmoid", gated=True),
}.items():
    ACTIVATIONS.register(_name, _entry, __name__)


def is_gated(name: str) -> bool:
    """Whether ``activation: name`` gates (its entry says so)."""
    return ACTIVATIONS[name].gated


def get_activation(name: str) -> Activation:
    return ACTIVATIONS[name].build()
