"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel ranks.

The full logits are never gathered: each rank contributes its max, its share of the softmax
denominator and (if it owns the target) the target logit, via three small all-reduces.
Computed in fp32 with the global max subtracted, so large logits do not overflow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=get_tensor_model_parallel_group())
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        vocab_per_rank = logits.shape[-1]
        start = get_tensor_model_parallel_rank() * vocab_per_rank

        global_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)  # [...]
        shifted = logits - global_max.unsqueeze(-1)  # [..., v/tp]

        ignored = target < 0  # e.g. -100: no loss, no gradient
        local_target = target - start
        not_mine = (local_target < 0) | (local_target >= vocab_per_rank) | ignored
        index = local_target.masked_fill(not_mine, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(not_mine, 0.0)
        target_logit = _all_reduce(target_logit)

        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1))
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, not_mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, index, not_mine, ignored = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target)
        grad = softmax.clone()
        owned = (~not_mine).unsqueeze(-1).to(grad.dtype)
        grad.scatter_add_(-1, index, -owned)
        grad.mul_((grad_loss * (~ignored).to(grad_loss.dtype)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (fp32, shape of `target`) from this rank's vocabulary shard of the logits.

    `logits`: `[..., vocab/tp]`, rank r holding columns `[r*v/tp, (r+1)*v/tp)`; `target`: `[...]`
    full-vocabulary ids. Negative targets (e.g. -100) give loss 0 and no gradient.
    """
    return _VocabParallelCrossEntropy.apply(logits, target)
