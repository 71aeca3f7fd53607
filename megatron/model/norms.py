"""Normalisation layers, chosen by the config string `norm`.

Parameters are constants at init (ones/zeros), so they are layout-independent without a seed.
The builders read the few settings they need through :class:`NormSettings` (``GPTConfig`` has them),
so this registry sits below the model config, which checks ``norm`` against it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class NormSettings(Protocol):
    """What the norm builders read from the model config (read-only: the config is frozen)."""

    @property
    def norm(self) -> str: ...
    @property
    def hidden_size(self) -> int | None: ...
    @property
    def layernorm_epsilon(self) -> float: ...
    @property
    def rms_norm_epsilon(self) -> float: ...
    @property
    def scalenorm_epsilon(self) -> float: ...
    @property
    def use_bias_in_norms(self) -> bool: ...
    @property
    def params_dtype(self) -> torch.dtype: ...


class RMSNorm(nn.RMSNorm):
    """GPT-NeoX's RMSNorm (``megatron/model/norms.py`` ``RMSNorm.forward`` at ea7aefd8):
    ``scale * x * rsqrt(mean(x^2) + eps)``, epsilon inside the root, computed in fp32 whatever the
    activation dtype and cast back after the scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)  # fp32
        return (normed * self.weight).to(x.dtype)


class ScaleNorm(nn.Module):
    """x / max(||x||, eps) * g, with one learned scalar g."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        del dim
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (x.float() / norm).to(x.dtype) * self.g


NORMS: dict[str, Callable[[int, NormSettings], nn.Module]] = {
    "layernorm": lambda dim, c: nn.LayerNorm(dim, c.layernorm_epsilon, bias=c.use_bias_in_norms, dtype=c.params_dtype),
    "rmsnorm": lambda dim, c: RMSNorm(dim, c.rms_norm_epsilon, dtype=c.params_dtype),
    "scalenorm": lambda dim, c: ScaleNorm(dim, c.scalenorm_epsilon, c.params_dtype),
    "non_parametric_layernorm": lambda dim, c: nn.LayerNorm(dim, c.layernorm_epsilon, elementwise_affine=False),
}
# Transformer Engine's fused kernels compute the same functions
NORMS["te_layernorm"] = NORMS["layernorm"]
NORMS["te_rmsnorm"] = NORMS["rmsnorm"]
"""`norm` config string -> builder(dim, config)."""


def build_norm(config: NormSettings, dim: int | None = None) -> nn.Module:
    if config.norm not in NORMS:
        raise ValueError(f"unknown norm {config.norm!r}; choose one of {sorted(NORMS)}")
    width = dim if dim is not None else config.hidden_size
    if width is None:
        raise ValueError("build_norm needs hidden_size (or the width `dim`)")
    return NORMS[config.norm](width, config)
