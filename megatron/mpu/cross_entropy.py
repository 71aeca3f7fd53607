"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel ranks.

The full logits are never gathered: per token, each rank computes the max of its shard and the sum
of exp(logit - max); a max and a sum all-reduce over `[tokens]` vectors combine the shards, and the
target logit comes from the rank that owns it (a third all-reduce). All in fp32, with the max
subtracted, so large logits neither overflow nor lose precision.

Chunked over tokens: the fp32 work (upcast, exp, softmax) runs on blocks of rows small enough to stay
in cache on a CPU and to bound the temporary memory on a GPU, so no `[tokens, vocab]` fp32 tensor
is ever materialised. The forward saves the logits themselves (in their own dtype, e.g. bf16) and
two fp32 numbers per token (max, sum of exp); the backward recomputes the softmax block by block and writes
`softmax - one_hot(target)` straight into the gradient.

The same pass yields each token's log-normaliser ``log Z = max + log(sum of exp)`` (the z-loss's
``log Z``, PaLM): :func:`vocab_parallel_cross_entropy_and_log_z` returns it as a second
differentiable output whose gradient (``softmax`` times the incoming gradient) joins the
cross-entropy's in the same block-wise backward, so a z-loss costs no fp32 copy of the logits either.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron.mpu.mappings import gather_from_tensor_model_parallel_region
from megatron.mpu.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

# Bytes of fp32 temporaries per block. On a GPU: large enough that the per-block launches do not
# matter, small next to the logits themselves. On a CPU with one thread: about a core's L2 (measured
# fastest). With several CPU threads every op of a block is a fork-join of the thread pool, and on
# shared cores those cost more than the cache misses of big blocks (measured: 64 blocks of 1 MiB took
# 1.5-2x as long as one 64 MiB block on 2 busy cores), so blocks are big.
_GPU_BLOCK_BYTES = 256 << 20
_CPU_BLOCK_BYTES = {1: 1 << 20}
_CPU_THREADED_BLOCK_BYTES = 64 << 20


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=get_tensor_model_parallel_group())
    return x


def default_block_rows(vocab_per_rank: int, device: torch.device) -> int:
    """Tokens per block: the fp32 temporaries of one block fill about the device's budget."""
    if device.type == "cpu":
        budget = _CPU_BLOCK_BYTES.get(torch.get_num_threads(), _CPU_THREADED_BLOCK_BYTES)
    else:
        budget = _GPU_BLOCK_BYTES
    return max(1, budget // (4 * vocab_per_rank))


def _shifted(block: torch.Tensor, by: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A new fp32 tensor `block - by[:, None]` (or written into `out`); `block` itself is never written."""
    if block.dtype == torch.float32:
        return torch.sub(block, by.unsqueeze(-1), out=out) if out is not None else block - by.unsqueeze(-1)
    return block.float().sub_(by.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(per-token loss, per-token log Z), both fp32 of the target's shape."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        vocab_per_rank = logits.shape[-1]
        flat = logits.reshape(-1, vocab_per_rank)  # [n, v/tp]
        n = flat.shape[0]

        # per token: the max m and sum exp(logits - m), kept apart so that logits - m stays exact
        # (a log-sum-exp of large logits would round at the scale of the logits themselves)
        top = torch.empty(n, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):
            block = flat[i : i + rows]
            top[i : i + rows] = block.amax(dim=-1)
            sum_exp[i : i + rows] = _shifted(block, top[i : i + rows]).exp_().sum(dim=-1)
        if get_tensor_model_parallel_world_size() > 1:
            local_top = top
            top = _all_reduce(local_top.clone(), dist.ReduceOp.MAX)
            sum_exp = _all_reduce(sum_exp.mul_((local_top - top).exp_()))

        target = target.reshape(-1)
        ignored = target < 0  # e.g. -100: no loss, no gradient
        local_target = target - get_tensor_model_parallel_rank() * vocab_per_rank
        not_mine = (local_target < 0) | (local_target >= vocab_per_rank) | ignored
        index = local_target.masked_fill(not_mine, 0).unsqueeze(-1)  # [n, 1]
        shifted_target = flat.gather(-1, index).squeeze(-1).float() - top
        shifted_target = _all_reduce(shifted_target.masked_fill_(not_mine, 0.0))

        log_sum_exp = sum_exp.log()
        loss = (log_sum_exp - shifted_target).masked_fill(ignored, 0.0)
        log_z = log_sum_exp + top  # log sum_v exp(logit_v) over the full vocabulary
        ctx.save_for_backward(logits, top, sum_exp, index, not_mine, ignored)
        ctx.rows = rows
        return loss.view(logits.shape[:-1]), log_z.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_log_z: torch.Tensor):
        logits, top, sum_exp, index, not_mine, ignored = ctx.saved_tensors
        vocab_per_rank = logits.shape[-1]
        flat = logits.reshape(-1, vocab_per_rank)
        n, rows = flat.shape[0], ctx.rows
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)  # [n]
        # d log Z / d logits = softmax: the log Z gradient adds to the softmax term only
        softmax_scale = ((scale + grad_log_z.reshape(-1).float()) / sum_exp).unsqueeze(-1)  # [n, 1]
        minus_owned = ((~not_mine).to(torch.float32) * -scale).unsqueeze(-1)  # -scale where this rank holds the target
        grad = torch.empty_like(flat)
        in_place = flat.dtype == torch.float32
        for i in range(0, n, rows):
            block = slice(i, i + rows)
            # d loss / d logits = softmax - one_hot(target), softmax = exp(logits - top) / sum_exp
            p = _shifted(flat[block], top[block], out=grad[block] if in_place else None)
            p.exp_().mul_(softmax_scale[block]).scatter_add_(-1, index[block], minus_owned[block])
            if not in_place:
                grad[block] = p
        return grad.view_as(logits), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 block_rows: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32, shape of `target`) from this rank's vocabulary shard of the logits.

    `logits`: `[..., vocab/tp]`, rank r holding columns `[r*v/tp, (r+1)*v/tp)`; `target`: `[...]`
    full-vocabulary ids. Negative targets (e.g. -100) give loss 0 and no gradient. `block_rows`:
    tokens per block of the fp32 work (default: `default_block_rows` for the device).
    """
    return vocab_parallel_cross_entropy_and_log_z(logits, target, block_rows)[0]


def vocab_parallel_cross_entropy_and_log_z(logits: torch.Tensor, target: torch.Tensor,
                                           block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token ``log Z``), both fp32 of `target`'s shape, from one chunked pass.

    ``log Z = log sum_v exp(logits_v)`` over the full vocabulary is defined for every token (ignored
    targets included); it is differentiable, its gradient being the softmax. Arguments as
    :func:`vocab_parallel_cross_entropy`.
    """
    if _TWICE.get():  # the whole vocabulary's logits on every tp rank, gathered differentiably (mpu.mappings)
        if get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return _plain_cross_entropy_and_log_z(logits, target)
    rows = block_rows or default_block_rows(logits.shape[-1], logits.device)
    return _VocabParallelCrossEntropy.apply(logits, target, rows)


_TWICE = contextvars.ContextVar("twice_differentiable", default=False)


@contextlib.contextmanager
def twice_differentiable() -> Iterator[None]:
    """The cross-entropy in plain torch ops, which autograd can differentiate again (the block-wise backward
    above cannot): for Sophia-H's Hessian-vector product (``megatron/engine/levanter_sophia.py``). Under tensor
    parallelism each rank first gathers the whole vocabulary's logits (more memory, for that pass only)."""
    token = _TWICE.set(True)
    try:
        yield
    finally:
        _TWICE.reset(token)


def _plain_cross_entropy_and_log_z(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two outputs as :func:`vocab_parallel_cross_entropy_and_log_z` on a whole vocabulary, in fp32."""
    full = logits.float()
    log_z = torch.logsumexp(full, dim=-1)  # [...]
    picked = full.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [...]
    return torch.where(target >= 0, log_z - picked, torch.zeros_like(log_z)), log_z
