"""MLP activations, chosen by the config string `activation`.

A gated activation takes the first projection's output as `[gate; up]` along the last dim
(each half `ffn_hidden_size` wide, or its tp shard) and returns `fn(gate) * up`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    fn: Callable[[torch.Tensor], torch.Tensor]
    gated: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fn(x)
        gate, up = x.chunk(2, dim=-1)
        return self.fn(gate) * up


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation(F.gelu),
    # GPT-2's "gelu_new" (Levanter's gpt2 default): the tanh approximation of GELU
    "gelu_tanh": Activation(functools.partial(F.gelu, approximate="tanh")),
    "relu": Activation(F.relu),
    "silu": Activation(F.silu),
    "swish": Activation(F.silu),
    "softsign": Activation(F.softsign),
    "mish": Activation(F.mish),
    "geglu": Activation(F.gelu, gated=True),
    "reglu": Activation(F.relu, gated=True),
    "swiglu": Activation(F.silu, gated=True),
    "bilinear": Activation(_identity, gated=True),
    "glu": Activation(torch.sigmoid, gated=True),
}


def get_activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
