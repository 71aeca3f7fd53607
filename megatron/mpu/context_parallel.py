"""Context parallelism: each sequence split over ``cp`` ranks, attention by all-to-all over heads.

Every rank holds a contiguous ``s / cp`` piece of each sequence for everything outside attention
(embedding, norms, MLP, loss: all per token). Attention needs every key, so around it two
all-to-alls swap the split (DeepSpeed-Ulysses' scheme): before, ``[b, n, s/cp, d]`` (all of this
rank's heads, its piece of the sequence) becomes ``[b, n/cp, s, d]`` (a ``1/cp`` share of the heads,
the whole sequence); after, back. In between, attention is the ordinary single-sequence attention:
causal, windows and document masks apply unchanged, the result is exact (no partial softmax to
merge), and every rank does the same work, so causal chunks need no load balancing.

Why not ring attention: it passes K/V blocks around the ring and merges partial softmaxes, which
changes the floating-point sums (the 1e-5 parity to a single rank would rest on that merge), needs
a load-balanced chunk order for causal masks, and per-document masks must be applied blockwise. Its
advantage - no head-count limit, cp beyond the number of heads - matters only past ``heads / tp``
ranks per sequence. The limit here: ``num_attention_heads / tp`` and ``num_kv_heads / tp`` must be
multiples of ``cp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.mpu.topology import get_context_parallel_group


def _all_to_all(x: torch.Tensor) -> torch.Tensor:
    """``x[j]`` goes to context-parallel rank ``j``; returns what each rank ``j`` sent here, at ``[j]``."""
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # the collective writes row-major
    dist.all_to_all_single(out, x, group=get_context_parallel_group())
    return out


def _sequence_to_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, n, s/cp, d]`` -> ``[b, n/cp, s, d]``: send head group j to rank j, gather the pieces."""
    b, n, piece, d = x.shape
    parts = x.reshape(b, cp, n // cp, piece, d).transpose(0, 1)  # [cp, b, n/cp, s/cp, d]
    got = _all_to_all(parts)  # [cp (whose piece), b, n/cp, s/cp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * piece, d)


def _heads_to_sequence(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, n/cp, s, d]`` -> ``[b, n, s/cp, d]``: the inverse of :func:`_sequence_to_heads`."""
    b, group, s, d = x.shape
    parts = x.reshape(b, group, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # [cp (whose piece), b, n/cp, s/cp, d]
    got = _all_to_all(parts)  # [cp (whose heads), b, n/cp, s/cp, d]
    return got.transpose(0, 1).reshape(b, cp * group, s // cp, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: int) -> torch.Tensor:
        ctx.cp = cp
        return _sequence_to_heads(x, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_sequence(grad, ctx.cp), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: int) -> torch.Tensor:
        ctx.cp = cp
        return _heads_to_sequence(x, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sequence_to_heads(grad, ctx.cp), None


def sequence_to_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, n, s/cp, d]`` (this rank's piece) -> ``[b, n/cp, s, d]`` (a share of the heads, whole sequence)."""
    return x if cp == 1 else _SequenceToHeads.apply(x, cp)


def heads_to_sequence(x: torch.Tensor, cp: int) -> torch.Tensor:
    """``[b, n/cp, s, d]`` -> ``[b, n, s/cp, d]``."""
    return x if cp == 1 else _HeadsToSequence.apply(x, cp)
