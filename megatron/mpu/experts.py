"""Expert parallelism over data-parallel ranks: process groups, token exchange, gradient reduction.

An MoE layer's experts are split first over the tensor-parallel group (GPT-NeoX's layout: tp rank t
holds a contiguous ``num_experts / tp`` of them) and then, with ``moe_expert_parallel_size = ep``,
over ``ep`` consecutive data-parallel ranks of the same (tp, pp) place: the *expert-parallel
group*. Each rank of it routes its own tokens and exchanges them with ``all_to_all_single`` so every
token reaches the rank holding its expert, and back.

Data-parallel rank ``d`` holds expert chunk ``d % ep``; the ranks holding the same chunk (``d``,
``d + ep``, ...) form the *expert-data-parallel group*. An expert's gradient on its rank already
sums the contributions of every token of its expert-parallel group (the all-to-all's backward
brought them back), so the full gradient is the sum over the expert-data-parallel group divided by
the data-parallel size, which is exactly the average a dense parameter gets over all data-parallel
ranks. :func:`reduce_expert_gradients` does that; DeepSpeed must not also average these gradients
over the whole data-parallel group (it would mix different experts): see
``megatron.engine.moe.install_expert_parallel``.

With ``ep == 1`` nothing here creates groups and every helper is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron.mpu.topology import get_data_parallel_world_size, get_topology
from megatron.torch_internals import flatten_dense_tensors, unflatten_dense_tensors


class _ExpertState:
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    edp_size: int = 1


_STATE = _ExpertState()

EXPERT_PARALLEL_ATTR = "expert_parallel"
"""Set on parameters that differ between the ranks of an expert-parallel group. Our own attribute,
not DeepSpeed's ``allreduce = False``: DeepSpeed honours that flag only for its own MoE layer class
(and fails on it otherwise)."""


def initialize_expert_parallel(ep: int) -> None:
    """Create the expert-parallel and expert-data-parallel groups. Call on every rank, after
    ``initialize_model_parallel``, in the same order."""
    destroy_expert_parallel()
    if ep <= 1:
        return
    topo = get_topology()
    dp = topo.get_dim("data")
    if dp % ep != 0:
        raise ValueError(f"moe_expert_parallel_size={ep} does not divide the data-parallel size {dp}")
    rank = dist.get_rank()
    for pipe in range(topo.get_dim("pipe")):
        for model in range(topo.get_dim("model")):
            dp_ranks = [topo.get_rank(pipe=pipe, data=d, model=model) for d in range(dp)]
            for block in range(dp // ep):  # consecutive data-parallel ranks split the experts
                ranks = dp_ranks[block * ep : (block + 1) * ep]
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    _STATE.ep_group, _STATE.ep_rank = group, ranks.index(rank)
            for chunk in range(ep):  # every ep-th data-parallel rank holds the same experts
                ranks = dp_ranks[chunk::ep]
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    _STATE.edp_group, _STATE.edp_size = group, len(ranks)
    _STATE.ep = ep


def destroy_expert_parallel() -> None:
    _STATE.ep, _STATE.ep_rank, _STATE.edp_size = 1, 0, 1
    _STATE.ep_group = _STATE.edp_group = None


def get_expert_parallel_world_size() -> int:
    """Data-parallel ranks that split one MoE layer's experts (1 = no split over data parallelism)."""
    return _STATE.ep


def get_expert_parallel_rank() -> int:
    return _STATE.ep_rank


# --- token exchange --------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` go to the ranks of the expert-parallel group in ``send`` sized blocks; the
    backward sends the gradients back the same way (the adjoint of a permutation is its inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        return _all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send), None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=_STATE.ep_group)
    return out


def exchange_tokens(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """All-to-all over the expert-parallel group: block i of ``x`` (``send[i]`` rows) goes to rank i,
    and ``recv[j]`` rows come from rank j, in rank order. Differentiable."""
    return _AllToAll.apply(x, send, recv)


def exchange_counts(counts: torch.Tensor) -> torch.Tensor:
    """``counts[i, e]``: tokens this rank sends for rank i's local expert e -> ``out[j, e]``: tokens
    rank j sends for this rank's expert e. One small all-to-all, no autograd."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=_STATE.ep_group)
    return out


# --- parameters and their gradients ----------------------------------------------------------------
def mark_expert_parallel(params: Iterable[nn.Parameter]) -> None:
    """Record that these parameters are split over the expert-parallel group (no-op when ep == 1)."""
    if _STATE.ep <= 1:
        return
    for param in params:
        setattr(param, EXPERT_PARALLEL_ATTR, True)


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, EXPERT_PARALLEL_ATTR, False))


def split_expert_parallel(params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters DeepSpeed reduces over data parallelism, parameters split over expert parallelism)."""
    dense: list[nn.Parameter] = []
    experts: list[nn.Parameter] = []
    for param in params:
        (experts if is_expert_parallel(param) else dense).append(param)
    return dense, experts


@torch.no_grad()
def reduce_expert_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum expert gradients over the expert-data-parallel group and divide by the data-parallel size
    (see the module docstring), one flat buffer per dtype."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    dp = get_data_parallel_world_size()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for bucket in by_dtype.values():
        flat = flatten_dense_tensors(bucket)
        if _STATE.edp_size > 1:
            dist.all_reduce(flat, group=_STATE.edp_group)
        flat.div_(dp)
        for grad, reduced in zip(bucket, unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def sum_over_expert_parallel(value: torch.Tensor) -> torch.Tensor:
    """Sum a (norm-squared) scalar over the expert-parallel group: its ranks hold different experts."""
    if _STATE.ep > 1:
        value = value.clone()
        dist.all_reduce(value, group=_STATE.ep_group)
    return value


@contextlib.contextmanager
def hidden_from_reduction(params: list[nn.Parameter]) -> Iterator[None]:
    """Let a data-parallel gradient reduction skip ``params``: DeepSpeed's non-ZeRO reduction
    (``_get_gradients_for_reduction``) walks the parameters that require grad."""
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


@contextlib.contextmanager
def preserved(params: list[nn.Parameter]) -> Iterator[None]:
    """Keep these parameters' values through a block that broadcasts every parameter from
    data-parallel rank 0 (``deepspeed.initialize`` does, so every replica starts equal)."""
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
