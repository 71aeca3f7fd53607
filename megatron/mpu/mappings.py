"""Autograd-aware communication over the tensor-parallel group.

Each mapping is a pair (forward op, backward op) whose backward is the adjoint of its forward:
copy <-> all-reduce, split <-> all-gather, reduce-scatter <-> all-gather. The tensor-parallel
layers are built from these, so gradients come out right without hooks in the model.

Last-dim mappings move between a replicated activation and a hidden-dim shard; first-dim
mappings implement sequence parallelism on `[s, b, h]` activations (the sequence is dim 0).
With one tensor-parallel rank every mapping is the identity.

Twice differentiable: under ``create_graph`` (grad mode on in the backward) each backward is its adjoint mapping's
autograd function, so the gradient is itself differentiable (Sophia-H's Hessian-vector product,
``megatron/engine/levanter_sophia.py``): copy's backward is reduce's forward and the reverse, split's is gather's and
the reverse, reduce-scatter's is the gather whose cotangents are partial (summed again by a reduce-scatter). Without
it (every training step) the backward runs the plain collectives, as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

# torch >= 2.10 renamed the single-tensor collectives; keep both spellings working
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- primitive collectives (no autograd) ---------------------------------------------------
def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tp group, in place: pass a tensor you own."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=get_tensor_model_parallel_group())
    return x


def _split_last(x: torch.Tensor) -> torch.Tensor:
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[-1] % world != 0:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tp={world}")
    return x.chunk(world, dim=-1)[get_tensor_model_parallel_rank()].contiguous()


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    # all-gather concatenates along dim 0 in rank order: gather there, move back to the last dim
    return _gather_first(x.movedim(-1, 0)).movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor) -> torch.Tensor:
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={world}")
    return x.chunk(world, dim=0)[get_tensor_model_parallel_rank()].contiguous()


def _gather_first(x: torch.Tensor) -> torch.Tensor:
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=get_tensor_model_parallel_group())
    return out


def _reduce_scatter_first(x: torch.Tensor) -> torch.Tensor:
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={world}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=get_tensor_model_parallel_group())
    return out


# --- autograd functions ---------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # create_graph: the backward itself differentiable (module docstring)
            return _ReduceFromTP.apply(grad)
        # the incoming gradient may be a caller's tensor: reduce a copy, never it in place
        return _all_reduce(grad.clone())


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(grad) if torch.is_grad_enabled() else grad


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _split_last(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _GatherFromTP.apply(grad) if torch.is_grad_enabled() else _gather_last(grad)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather_last(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _ScatterToTP.apply(grad) if torch.is_grad_enabled() else _split_last(grad)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _split_first(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _GatherFromSP.apply(grad, False) if torch.is_grad_enabled() else _gather_first(grad)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, grad_is_partial: bool) -> torch.Tensor:
        ctx.grad_is_partial = grad_is_partial
        return _gather_first(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a tensor-parallel consumer leaves each rank a partial gradient: sum, then keep our part
        if torch.is_grad_enabled():
            return (_ReduceScatterToSP.apply(grad) if ctx.grad_is_partial else _ScatterToSP.apply(grad)), None
        if ctx.grad_is_partial:
            return _reduce_scatter_first(grad), None
        return _split_first(grad), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_first(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _GatherFromSP.apply(grad, True) if torch.is_grad_enabled() else _gather_first(grad)


# --- public API -------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (the input feeds every rank's shard)."""
    return _CopyToTP.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: all-reduce the partial results. Backward: identity."""
    return _ReduceFromTP.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dim. Backward: all-gather it."""
    return _ScatterToTP.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: all-gather along the last dim. Backward: keep this rank's slice."""
    return _GatherFromTP.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: keep this rank's slice of the sequence (dim 0). Backward: all-gather."""
    return _ScatterToSP.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor, grad_is_partial: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence (dim 0).

    Backward: reduce-scatter when the consumer is tensor-parallel (each rank holds a partial
    gradient), else split (every rank holds the full gradient).
    """
    return _GatherFromSP.apply(x, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: sum the partial results and keep this rank's slice of dim 0. Backward: all-gather."""
    return _ReduceScatterToSP.apply(x)
