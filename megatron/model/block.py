"""What every layer of the stack is: a :class:`Block` maps hidden states `[s, b, h]` to `[s, b, h]`.

A transformer block (``transformer_layer.py``), a Mamba layer (``mamba.py``), an RWKV-6 layer
(``rwkv.py``) and a gMLP block (``gmlp.py``) all take ``(x, position_ids, attention_mask, kv_cache,
document_ids)`` by position, so the model, activation checkpointing, the pipeline wrappers and the
inference stages treat them alike; which one a layer is comes from its ``attention_config`` type
(``blocks.py``). A recurrent layer keeps its decoding state in the :class:`~megatron.model.kv_cache.KVCache`
under its layer number, as two batch-first tensors, like an attention layer's keys and values.

The helpers below make a layer's own parameters the way ``mpu.layers`` makes a linear layer's: the full
tensor drawn from ``(seed, canonical name)``, then this tensor-parallel rank's part of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from megatron.mpu.initialize_weights import InitFn, initialize_param_, set_tensor_model_parallel_attributes
from megatron.mpu.topology import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size


class Block(nn.Module):
    """One layer of the stack. ``forward(x, position_ids, attention_mask, kv_cache, document_ids)``."""

    layer_number: int

    def block_forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: object | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's own forward, also on a pipeline wrapper (whose ``forward`` takes a tuple)."""
        return self.forward(x, position_ids, attention_mask, kv_cache, document_ids)


def layer_parameter(
    full_shape: Sequence[int],
    *,
    name: str,
    seed: int,
    init_fn: InitFn,
    dim: int | None = None,
    sections: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Parameter:
    """A parameter drawn whole from ``(seed, name)``; split along ``dim`` over tensor-parallel ranks (None:
    every rank holds it whole)."""
    world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    shape = list(full_shape)
    if dim is not None:
        if shape[dim] % world:
            raise ValueError(f"{name}: dimension {dim} of {tuple(full_shape)} does not split over {world} ranks")
        shape[dim] //= world
    param = nn.Parameter(torch.empty(shape, dtype=dtype))
    initialize_param_(param, name, seed, init_fn, full_shape, dim, rank, world, sections)
    set_tensor_model_parallel_attributes(param, dim is not None, -1 if dim is None else dim, sections)
    return param


def fill_parameter_(param: torch.Tensor, full_shape: Sequence[int], *, name: str, seed: int, init_fn: InitFn,
                    dim: int | None = None) -> None:
    """Fill an existing parameter (of a torch module) with its part of the full tensor drawn from ``(seed, name)``."""
    world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    initialize_param_(param, name, seed, init_fn, full_shape, dim, rank, world)
    set_tensor_model_parallel_attributes(param, dim is not None, -1 if dim is None else dim)


# --- init functions (fill a full fp32 tensor from a generator) -----------------------------------------
def uniform(bound: float) -> InitFn:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        t.uniform_(-bound, bound, generator=gen)

    return init


def constant(value: float) -> InitFn:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        t.fill_(value)

    return init


def torch_linear_default(fan_in: int) -> InitFn:
    """``nn.Linear``'s own init of weight and bias (kaiming-uniform with a = sqrt(5): U(+-1/sqrt(fan_in)))."""
    return uniform(1.0 / math.sqrt(fan_in))
