"""The norm modules that torch does not have as they are needed (built through ``norms.py``'s registry)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
