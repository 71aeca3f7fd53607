"""Log-probabilities and log-normalisers on vocab-parallel logits.

Both work on this rank's vocabulary shard ``[..., v/tp]`` and give the full-vocabulary value on every
tensor-parallel rank, without gathering the logits: the log-probability is the negated
vocab-parallel cross-entropy (fp32 inside, three small all-reduces), the log-normaliser a max
all-reduce plus a differentiable sum all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.mappings import reduce_from_tensor_model_parallel_region
from megatron.mpu.topology import get_tensor_model_parallel_group, get_tensor_model_parallel_world_size


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(label_t)`` per position, fp32 ``[n, s]``; 0 where ``labels < 0`` (no loss there)."""
    return -vocab_parallel_cross_entropy(logits, labels)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Summed log-probability of each row's counted labels ``[n]``.

    ``fp32=False`` (``dpo_fp32``/``kto_fp32: false``) rounds the per-token values to the logits' dtype
    and sums in it, as a model computing its log-softmax in bf16/fp16 would; ``True`` keeps fp32.
    """
    per_token = token_logps(logits, labels)  # [n, s] fp32
    if not fp32:
        per_token = per_token.to(logits.dtype)
    return per_token.sum(dim=-1)


def vocab_parallel_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``log sum_v exp(logits_v)`` over the full vocabulary, fp32, differentiable (gradient: softmax).

    The max is only a shift for stability (the result does not depend on it), so it is detached;
    the sum of exponentials is all-reduced forward and its gradient reaches every shard unchanged.
    """
    x = logits.float()
    shift = x.detach().max(dim=-1).values
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=get_tensor_model_parallel_group())
    local = (x - shift.unsqueeze(-1)).exp().sum(dim=-1)
    return shift + reduce_from_tensor_model_parallel_region(local).log()
