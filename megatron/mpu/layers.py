"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each layer allocates only this rank's shard, fills it from the full weight drawn for its
canonical name (see `initialize_weights`), and marks its parameters for DeepSpeed. Activations
are `[s, b, h]`; with sequence parallelism the input of a column-parallel layer and the output of a
row-parallel layer are sequence shards `[s/tp, b, h]`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.mpu.initialize_weights import (
    InitFn,
    initialize_param_,
    set_tensor_model_parallel_attributes,
)
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.topology import (
    collective_device,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _divide(n: int, world: int, what: str) -> int:
    if n % world != 0:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {world}")
    return n // world


def mark_partial_over_tensor_parallel(params: Iterable[nn.Parameter]) -> None:
    """Mark replicated parameters whose gradient each tp rank computes only in part.

    A parameter that is the same on every tp rank but sees only part of the data there (a norm over
    heads split across ranks, any replicated parameter under sequence parallelism) gets a partial
    gradient on each rank; its gradient is the sum over the tp group. That sum is not taken here, per
    parameter and micro-batch (a hook each: dozens of small all-reduces per backward), but once per
    optimizer step for every marked parameter together (:func:`sum_partial_grads_over_tensor_parallel`,
    called by the trainer after the data-parallel reduction, where Megatron-LM's
    ``finalize_model_grads`` calls ``_allreduce_non_tensor_model_parallel_grads``: one flattened
    all-reduce, megatron/core/distributed/finalize_model_grads.py:416 and :661 at d98e8a6; GPT-NeoX
    registers a hook per norm parameter, megatron/model/utils.py:397 at ea7aefd, as Deepy did). Whoever
    runs a backward without the trainer calls it before using the gradients.
    """
    if get_tensor_model_parallel_world_size() == 1:
        return
    for param in params:
        param.partial_over_tp = True  # type: ignore[attr-defined]  # a mark torch.Tensor does not declare


def partial_over_tensor_parallel(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``module`` marked by :func:`mark_partial_over_tensor_parallel`, in order."""
    return [p for p in module.parameters() if p.requires_grad and getattr(p, "partial_over_tp", False)]


def sum_partial_grads_over_tensor_parallel(grads: Sequence[torch.Tensor]) -> None:
    """Replace each gradient (any dtype and device, each a piece of a marked parameter's gradient that
    every tp rank holds in the same layout) by its sum over the tp group: one all-reduce of all of
    them, flattened in fp32 on the collective's device."""
    if get_tensor_model_parallel_world_size() == 1 or not grads:
        return
    group = get_tensor_model_parallel_group()
    flat = torch.cat([g.detach().reshape(-1).to(collective_device(group), torch.float32) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.detach().copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows: each rank computes its slice of y.

    `sections` describes a fused output (e.g. [q, k, v] sizes); each section is split across
    ranks separately so that a rank's output is [q_r, k_r, v_r].
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        name: str,
        init_fn: InitFn,
        seed: int,
        bias: bool = True,
        gather_output: bool = False,
        sections: Sequence[int] | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        world = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        if gather_output and sections is not None and len(sections) > 1:
            raise ValueError("gather_output of a fused (sectioned) projection would interleave the sections")
        self.input_size, self.output_size = input_size, output_size
        self.canonical_name = name  # seeds this layer's weights (and an adapter's, megatron/model/lora.py)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and world > 1
        self.sections = list(sections) if sections is not None else [output_size]
        self.output_size_per_partition = _divide(output_size, world, f"{name} output size")

        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype))
        initialize_param_(
            self.weight, f"{name}.weight", seed, init_fn, (output_size, input_size), 0, rank, world, self.sections
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, self.sections)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype)
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, self.sections)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, grad_is_partial=True)  # [s, b, h]
        else:
            x = copy_to_tensor_model_parallel_region(x)
        y = F.linear(x, self.weight, self.bias)  # [s, b, out/tp]
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, out_per_rank={self.output_size_per_partition}"


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns: each rank multiplies its input shard, then sum."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        name: str,
        init_fn: InitFn,
        seed: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        world = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        self.input_size, self.output_size = input_size, output_size
        self.canonical_name = name  # seeds this layer's weights (and an adapter's, megatron/model/lora.py)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs a row-parallel layer whose input is already split")
        self.input_size_per_partition = _divide(input_size, world, f"{name} input size")

        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype))
        initialize_param_(self.weight, f"{name}.weight", seed, init_fn, (output_size, input_size), 1, rank, world)
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            # added once, after the sum: replicated on every rank
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, False)
            if self.sequence_parallel:
                # the bias is added to a sequence shard, so each rank's gradient is partial
                mark_partial_over_tensor_parallel([self.bias])
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tensor_model_parallel_world_size() == 1:
            return F.linear(x, self.weight, self.bias)  # nothing to sum: the bias rides in the matmul
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        partial = F.linear(x, self.weight)  # [s, b, out], this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial)  # [s/tp, b, out]
        else:
            y = reduce_from_tensor_model_parallel_region(partial)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.input_size}, in_per_rank={self.input_size_per_partition}, out={self.output_size}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split across tp ranks.

    Each rank looks up the tokens it owns (others give zeros), then the results are summed.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        name: str,
        init_fn: InitFn,
        seed: int,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        world = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _divide(num_embeddings, world, f"{name} vocabulary size")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank

        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=params_dtype))
        initialize_param_(
            self.weight, f"{name}.weight", seed, init_fn, (num_embeddings, embedding_dim), 0, rank, world
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.vocab_start == 0 and self.vocab_end == self.num_embeddings:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, rows=[{self.vocab_start}, {self.vocab_end}), dim={self.embedding_dim}"



def parallel_lm_logits(x_sbh: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """Vocab-parallel logits `[b, s, v/tp]` from hidden `[s, b, h]` (or its sequence shard) and `weight` `[v/tp, h]`."""
    if sequence_parallel and get_tensor_model_parallel_world_size() > 1:
        x_sbh = gather_from_sequence_parallel_region(x_sbh, grad_is_partial=True)
    else:
        x_sbh = copy_to_tensor_model_parallel_region(x_sbh)
    # batch-first before the projection: transposing h-wide hidden states is v/h times cheaper than
    # transposing the logits (and their gradient) afterwards
    return F.linear(x_sbh.transpose(0, 1), weight)  # [b, s, v/tp]
