"""Normalisation layers, chosen by the config string ``norm``: one registry entry per norm.

An entry builds the module over ``dim`` features and states its parameter count, its FLOPs per token
(the 6N convention of ``flops.py``: each weight is 2 forward and 4 backward FLOPs per token; the
elementwise arithmetic is not counted, as for every other layer) and whether it keeps an fp32 copy of
its input for the backward (the memory estimate). No torch import: the builders import it when called
(the modules torch lacks are in ``norm_layers.py``), so the launcher and ``--dry-run`` count without it.

Parameters are constants at init (ones/zeros), so they are layout-independent without a seed.
The builders read the few values they need from a frozen :class:`NormSettings` that the model config
builds (``GPTConfig.norm_settings``), so this registry sits below the model config, whose ``norm`` key
accepts its names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.errors import required
from megatron.model.option_registry import OptionRegistry

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class NormSettings:
    """The plain values the norm builders read, built by the model config (``GPTConfig.norm_settings``),
    which sits above this registry."""

    norm: str
    """The ``norm`` key: which registry entry."""
    hidden_size: int | None
    """Features of a norm built without an explicit ``dim``."""
    layernorm_epsilon: float
    rms_norm_epsilon: float
    scalenorm_epsilon: float
    use_bias_in_norms: bool
    dtype_name: str
    """torch's name of the weights' dtype (``float32``, ``bfloat16``, ``float16``): no torch import to count."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype the weights are created in."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype


NORM_KEYS = ("use_bias_in_norms", "layernorm_epsilon", "rms_norm_epsilon", "scalenorm_epsilon")
"""The model keys a norm builder may read (besides the dtype and its width)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NormEntry:
    """One ``norm`` value."""

    build: Callable[[int, NormSettings], nn.Module]
    """The module over ``dim`` features."""
    parameters: Callable[[int, NormSettings], int]
    """Its parameter count (what ``build`` makes: a test compares)."""
    keeps_fp32_input: bool = False
    """Autograd keeps an fp32 copy of a 16-bit input (torch's rms_norm on the upcast input)."""
    reads: tuple[str, ...] = NORM_KEYS
    """The keys of :data:`NORM_KEYS` its module depends on; the others change nothing for this norm (an
    RMSNorm has no bias and no LayerNorm epsilon, whatever ``use_bias_in_norms`` says). A plug-in that
    leaves it out reads them all. ``tests/unit/test_option_registries.py`` changes each key and compares."""
    gpu_library: str | None = None
    """Import name of the library running only on an NVIDIA GPU that builds the module (``transformer_engine``);
    None for a torch module, built anywhere."""

    def flops_per_token(self, dim: int, settings: NormSettings) -> float:
        """Training FLOPs per token counted for MFU: 6 per weight (the elementwise work is not counted)."""
        return 6.0 * self.parameters(dim, settings)


NORMS: OptionRegistry[NormEntry] = OptionRegistry("norm")
"""``norm`` config string -> entry."""


def register_norm(name: str, entry: NormEntry) -> NormEntry:
    """Add a norm (a plug-in file calls this; the caller's module owns the name)."""
    owner = getattr(entry.build, "__module__", "") or ""
    return NORMS.register(name, entry, owner)


def _layernorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from torch import nn

    return nn.LayerNorm(dim, c.layernorm_epsilon, bias=c.use_bias_in_norms, dtype=c.params_dtype)


def _rmsnorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from megatron.model.norm_layers import RMSNorm

    return RMSNorm(dim, c.rms_norm_epsilon, dtype=c.params_dtype)


def _gemma_rmsnorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from megatron.model.norm_layers import GemmaRMSNorm

    return GemmaRMSNorm(dim, c.rms_norm_epsilon, c.params_dtype)


def _non_parametric_rmsnorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from megatron.model.norm_layers import NonParametricRMSNorm

    return NonParametricRMSNorm(dim, c.rms_norm_epsilon)


def _scalenorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from megatron.model.norm_layers import ScaleNorm

    return ScaleNorm(dim, c.scalenorm_epsilon, c.params_dtype)


def _non_parametric_layernorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from torch import nn

    return nn.LayerNorm(dim, c.layernorm_epsilon, elementwise_affine=False)


_LAYERNORM = NormEntry(build=_layernorm, parameters=lambda dim, c: dim * (2 if c.use_bias_in_norms else 1),
                       reads=("use_bias_in_norms", "layernorm_epsilon"))
# GPT-NeoX's RMSNorm has no bias either: get_norm hands over only the epsilon (megatron/model/norms.py:19-59,
# transformer.py:931-934 at ea7aefd8: RMSNorm(dim, eps=eps), bias=False), so use_bias_in_norms changes nothing there either
_RMSNORM = NormEntry(build=_rmsnorm, parameters=lambda dim, c: dim, keeps_fp32_input=True,
                     reads=("rms_norm_epsilon",))
register_norm("layernorm", _LAYERNORM)
register_norm("rmsnorm", _RMSNORM)
# Gemma's (1 + w) gain, w from zeros (norm_layers.GemmaRMSNorm): the same parameter count as rmsnorm
register_norm("gemma_rmsnorm", NormEntry(build=_gemma_rmsnorm, parameters=lambda dim, c: dim, keeps_fp32_input=True,
                                         reads=("rms_norm_epsilon",)))
register_norm("non_parametric_layernorm", NormEntry(build=_non_parametric_layernorm, parameters=lambda dim, c: 0,
                                                   reads=("layernorm_epsilon",)))
# Levanter's RmsNorm with use_weight false (its Llama-family use_layer_norm_weight: false); not a GPT-NeoX norm
register_norm("non_parametric_rmsnorm", NormEntry(build=_non_parametric_rmsnorm, parameters=lambda dim, c: 0,
                                                 keeps_fp32_input=True, reads=("rms_norm_epsilon",)))
register_norm("scalenorm", NormEntry(build=_scalenorm, parameters=lambda dim, c: 1, reads=("scalenorm_epsilon",)))


def _te_rmsnorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: CUDA-only library (requirements/requirements-kernels.txt); refused before launch where missing
    import transformer_engine.pytorch as te

    module: nn.Module = te.RMSNorm(dim, eps=c.rms_norm_epsilon, params_dtype=c.params_dtype, device="cuda")
    return module


def _te_layernorm(dim: int, c: NormSettings) -> nn.Module:
    # lazy: CUDA-only library (requirements/requirements-kernels.txt); refused before launch where missing
    import transformer_engine.pytorch as te

    module: nn.Module = te.LayerNorm(dim, eps=c.layernorm_epsilon, params_dtype=c.params_dtype, device="cuda")
    return module


# Transformer Engine's kernels (GPT-NeoX ea7aefd8 norms.py:47-56, transformer_engine.py TERMSNorm/TELayerNorm: the
# epsilon keys, no bias option): its LayerNorm always has a bias, initialised to zeros
register_norm("te_rmsnorm", NormEntry(build=_te_rmsnorm, parameters=lambda dim, c: dim, reads=("rms_norm_epsilon",),
                                      gpu_library="transformer_engine"))
register_norm("te_layernorm", NormEntry(build=_te_layernorm, parameters=lambda dim, c: 2 * dim,
                                        reads=("layernorm_epsilon",), gpu_library="transformer_engine"))


def norm_entry(config: NormSettings) -> NormEntry:
    return NORMS[config.norm]


def build_norm(config: NormSettings, dim: int | None = None) -> nn.Module:
    """The config's norm over ``dim`` features (``hidden_size`` when None)."""
    width = required(config.hidden_size, "hidden_size", "a norm is built over it") if dim is None else dim
    return norm_entry(config).build(width, config)


def norm_parameters(config: NormSettings, dim: int) -> int:
    """Parameters of one of the config's norms over ``dim`` features."""
    return norm_entry(config).parameters(dim, config)
