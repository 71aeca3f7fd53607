"""Normalisation layers, chosen by the config string `norm`.

Parameters are constants at init (ones/zeros), so they are layout-independent without a seed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig


class LayerNorm(nn.Module):
    """(x - mean) / std * weight (+ bias)."""

    def __init__(self, dim: int, eps: float, bias: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (+ bias), computed in fp32."""

    def __init__(self, dim: int, eps: float, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        out = normed * self.weight
        return out if self.bias is None else out + self.bias


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


class NonParametricLayerNorm(nn.Module):
    """Layer norm without weight or bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], None, None, self.eps)


NORMS: dict[str, Callable[[int, GPTConfig], nn.Module]] = {
    "layernorm": lambda dim, c: LayerNorm(dim, c.layernorm_epsilon, c.use_bias_in_norms, c.params_dtype),
    "rmsnorm": lambda dim, c: RMSNorm(dim, c.rms_norm_epsilon, False, c.params_dtype),
    "scalenorm": lambda dim, c: ScaleNorm(dim, c.scalenorm_epsilon, c.params_dtype),
    "non_parametric_layernorm": lambda dim, c: NonParametricLayerNorm(dim, c.layernorm_epsilon),
}
# Transformer Engine's fused kernels compute the same functions
NORMS["te_layernorm"] = NORMS["layernorm"]
NORMS["te_rmsnorm"] = NORMS["rmsnorm"]
"""`norm` config string -> builder(dim, config)."""


def build_norm(config: GPTConfig, dim: int | None = None) -> nn.Module:
    if config.norm not in NORMS:
        raise ValueError(f"unknown norm {config.norm!r}; choose one of {sorted(NORMS)}")
    return NORMS[config.norm](config.hidden_size if dim is None else dim, config)
