"""The norm modules that torch does not have as they are needed (built through ``norms.py``'s registry)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.initialize_weights import set_tensor_model_parallel_attributes
from megatron.mpu.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.mpu.topology import get_tensor_model_parallel_world_size


class RMSNorm(nn.RMSNorm):
    """GPT-NeoX's RMSNorm (``megatron/model/norms.py`` ``RMSNorm.forward`` at ea7aefd8):
    ``scale * x * rsqrt(mean(x^2) + eps)``, epsilon inside the root, computed in fp32 whatever the
    activation dtype and cast back after the scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)  # fp32
        return (normed * self.weight).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast back after the scale, ``w``
    starting at zeros (transformers 5.23.0 models/gemma2/modeling_gemma2.py:48-62, 365-367; Levanter's
    GemmaRMSNorm, gemma.py:259-291@9263f81e)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)  # fp32
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class NonParametricRMSNorm(nn.Module):
    """RMSNorm without a gain: ``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back (Levanter's RmsNorm with
    ``use_weight: false``, the norm of its Llama-family configs with ``use_layer_norm_weight: false``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.normalized_shape, self.eps = (dim,), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(x.dtype)


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


class TensorParallelRMSNorm(nn.Module):
    """RMSNorm over ``dim`` features that tensor parallelism splits into equal contiguous shards, one per rank
    (a projection's heads): each rank holds its shard's gains and sums its features' squares, the sum is
    reduced over the tensor-parallel group, so every rank normalises by the root mean square of all ``dim``
    features, as one RMSNorm over the gathered features would (OLMo 2's q_norm/k_norm over heads x head_dim:
    transformers 5.23.0 models/olmo2/modeling_olmo2.py:50-64, 213-228; in fp32, epsilon inside the root)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        world = get_tensor_model_parallel_world_size()  # divides dim: the heads split evenly (kv_heads_fit)
        self.dim, self.eps, self.world = dim, eps, world
        self.weight = nn.Parameter(torch.ones(dim // world, dtype=dtype))  # ones: the same at every layout
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim / tp] -> the same
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)  # [..., 1]
        if self.world > 1:
            # forward: the sum over ranks; backward: every rank's features depend on it, so its gradient is
            # the sum of the ranks' gradients too (copy_to's backward all-reduce)
            squares = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(squares))
        normed = xf * torch.rsqrt(squares / self.dim + self.eps)
        return (normed * self.weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim} over {self.world} rank(s), eps={self.eps}"
