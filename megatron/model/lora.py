"""LoRA adapters on the tensor-parallel projections, attached to a built model from outside.

``y = W x + b + (alpha / r) * B A dropout(x)`` with ``A`` ``[r, in]`` drawn like PEFT's (uniform in
``+-1/sqrt(in)``) and ``B`` ``[out, r]`` zero, so a fresh adapter leaves the model unchanged
(``lora_init: levanter`` draws both as Levanter does instead). The base weights are frozen; the adapters are
the only trainable parameters (plus a reward model's new scalar head, which has no base to keep).

``lora_split_fused`` gives each section of a fused projection (q, k, v; gate, up) its own adapter, as Levanter
and PEFT adapt a Llama's separate projections: ``A`` stacks the sections' ``A_s`` (``[S r, in]``) and ``B``
keeps the layer's row layout, so ``B`` is block-diagonal in effect. The untied output head
(``output_layer``) is adapted like any column-parallel layer, its logits batch-first.

Tensor parallelism splits each adapter like the layer it adapts:

* column-parallel (output rows split, e.g. ``query_key_value``): ``B`` is split by rows with the
  layer's sections (``[q_r; k_r; v_r]``), ``A`` is replicated. The rank-``r`` product ``A x`` is the
  same on every tp rank; its gradient is partial (each rank sees its output slice) and is summed by
  :func:`copy_to_tensor_model_parallel_region` placed *after* ``A`` - an all-reduce of ``r`` numbers
  per token rather than of the hidden state.
* row-parallel (input columns split, e.g. ``dense_4h_to_h``): ``A`` is split by columns, ``B`` is
  replicated; the partial ``A x`` is summed before ``B`` (again ``r`` numbers per token).

With sequence parallelism the replicated factor sees a sequence shard, so its gradient is partial
and is summed over the tp group by a hook (as for norms). Each adapter is its own ``nn.Module``
called from a forward hook of its layer, so ZeRO-3 gathers its partitioned weights like any
other module's.

The state-dict names are the layer's plus ``.adapter.lora_A`` / ``.adapter.lora_B``: the base names are
untouched, so a base checkpoint loads into the adapted model and the export can drop or merge the
adapters (``megatron/interop/lora_export.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.errors import ConfigError
from megatron.model.embedding import GPTEmbedding
from megatron.model.gpt import OutputLayer, ValueHead
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.initialize_weights import InitFn, initialize_param_, set_tensor_model_parallel_attributes
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, mark_partial_over_tensor_parallel
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.mpu.random import tensor_parallel_rng
from megatron.mpu.topology import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

# the projections an adapter can target, by the last part of their module name (GPT-NeoX's names,
# which are also what PEFT's target_modules name on a Hugging Face GPTNeoX model)
TARGETS: dict[str, type[ColumnParallelLinear] | type[RowParallelLinear] | type[OutputLayer]] = {
    "query_key_value": ColumnParallelLinear,
    "dense": RowParallelLinear,
    "dense_h_to_4h": ColumnParallelLinear,
    "dense_4h_to_h": RowParallelLinear,
    "output_layer": OutputLayer,  # an untied head (vocab-parallel rows); a tied one is the embedding
}

ADAPTER = "adapter"
"""Attribute name of the adapter module on its layer (hence the state-dict infix)."""


def _peft_a(fan_in: int) -> InitFn:
    bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming_uniform_(a=sqrt(5)) over the full input

    def uniform(t: torch.Tensor, gen: torch.Generator) -> None:
        t.uniform_(-bound, bound, generator=gen)
    return uniform


def _zero(t: torch.Tensor, gen: torch.Generator) -> None:
    t.zero_()


def truncated_normal(fan_in: int) -> InitFn:
    """haliax's ``Linear.init`` (haliax@f41e7d40 src/haliax/nn/linear.py:41-69, init_scale 1): a standard normal
    truncated to [-3, 3], over sqrt(fan_in)."""
    scale = 1.0 / math.sqrt(fan_in)

    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        torch.nn.init.trunc_normal_(t, 0.0, 1.0, -3.0, 3.0, generator=gen)
        t.mul_(scale)
    return init


def _inits(config: LoRAArgs, fan_in: int) -> tuple[InitFn, InitFn]:
    """(A's, B's) init: PEFT's (B zero) or Levanter's (both drawn, lora.py:148-152@9263f81e)."""
    if config.lora_init == "levanter":
        return truncated_normal(fan_in), truncated_normal(config.lora_r)
    return _peft_a(fan_in), _zero


class LoRAAdapter(nn.Module):
    """The low-rank update of one column- or row-parallel layer: ``forward(x)`` is the term added
    to the layer's output.

    With ``lora_split_fused`` a fused column-parallel layer (sections ``[q, k, v]`` or ``[gate, up]``) gets one
    adapter per section: ``A`` holds the sections' ``A_s`` stacked (``[S r, in]``, replicated) and ``B`` the
    ``B_s`` stacked by rows exactly like the layer's weight (``[out/tp, r]``, split by sections), so section
    ``s``'s rows of the output are ``B[rows_s] (A_s x)``: one adapter with a block-diagonal ``B``."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, config: LoRAArgs, seed: int) -> None:
        super().__init__()
        world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        name = f"{base.canonical_name}.{ADAPTER}"
        self.column = isinstance(base, ColumnParallelLinear)
        self.batch_first = isinstance(base, OutputLayer)  # the head's logits are [b, s, v/tp]
        self.sequence_parallel = base.sequence_parallel
        self.scale = config.lora_scale
        self.dropout = config.lora_dropout
        r = config.lora_r
        like = base.weight
        # this rank's rows of each section of B (one section unless a fused layer is split)
        self.local_sections: list[int] = [like.shape[0]]
        # the factor on the split side of the layer is split with it; the other is replicated
        if isinstance(base, ColumnParallelLinear):  # self.column, narrowed for the checker
            pieces = len(base.sections) if config.lora_split_fused else 1
            if pieces > 1:
                self.local_sections = [size // world for size in base.sections]
            a_full, b_full = (pieces * r, base.input_size), (base.output_size, r)
            a_local, b_local = a_full, (base.output_size_per_partition, r)
        else:
            a_full, b_full = (r, base.input_size), (base.output_size, r)
            a_local, b_local = (r, base.input_size_per_partition), b_full
        self.lora_A = nn.Parameter(torch.empty(a_local, dtype=like.dtype, device=like.device))
        self.lora_B = nn.Parameter(torch.empty(b_local, dtype=like.dtype, device=like.device))
        init_a, init_b = _inits(config, base.input_size)
        with torch.no_grad():
            if isinstance(base, ColumnParallelLinear):
                initialize_param_(self.lora_A, f"{name}.lora_A", seed, init_a, a_full)
                initialize_param_(self.lora_B, f"{name}.lora_B", seed, init_b, b_full, 0, rank, world, base.sections)
            else:
                initialize_param_(self.lora_A, f"{name}.lora_A", seed, init_a, a_full, 1, rank, world)
                initialize_param_(self.lora_B, f"{name}.lora_B", seed, init_b, b_full)
        if isinstance(base, ColumnParallelLinear):
            set_tensor_model_parallel_attributes(self.lora_A, False)
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, base.sections)
            replicated = self.lora_A
        else:
            set_tensor_model_parallel_attributes(self.lora_A, True, 1)
            set_tensor_model_parallel_attributes(self.lora_B, False)
            replicated = self.lora_B
        if self.sequence_parallel:
            # the replicated factor meets a sequence shard on each rank: its gradient is partial
            mark_partial_over_tensor_parallel([replicated])
        self.enabled = True

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        # the input is replicated over tp ranks (same mask) unless it is a shard (per-rank stream)
        sharded = self.sequence_parallel or not self.column
        with tensor_parallel_rng() if sharded else contextlib.nullcontext():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0 and self.training and len(self.local_sections) > 1:
            # each section's adapter drops its input on its own, as separate modules do (Levanter, PEFT)
            h = torch.cat([F.linear(self._dropped(x), a_s) for a_s in self.lora_A.split(self.lora_B.shape[1])], -1)
        else:
            h = F.linear(self._dropped(x) if self.dropout > 0 and self.training else x, self.lora_A)
        # h: [..., S r], partial over tp for a row-parallel layer
        if self.column:
            if self.sequence_parallel:
                h = gather_from_sequence_parallel_region(h, grad_is_partial=True)  # [s, b, S r]
            else:
                h = copy_to_tensor_model_parallel_region(h)  # backward: sum the ranks' partial grads
        elif self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h)  # [s/tp, b, r]
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        if self.batch_first:
            h = h.transpose(0, 1)  # [b, s, r], as the head's logits
        if len(self.local_sections) == 1:
            return F.linear(h, self.lora_B) * self.scale  # [..., out/tp] (column) or [..., out] (row)
        r = self.lora_B.shape[1]
        rows = self.lora_B.split(self.local_sections, dim=0)
        parts = [F.linear(h[..., i * r:(i + 1) * r], b_s) for i, b_s in enumerate(rows)]  # section s: B_s A_s x
        return torch.cat(parts, dim=-1) * self.scale  # [..., out/tp], sections in the layer's order


def _add_adapter_output(layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    adapter: LoRAAdapter = getattr(layer, ADAPTER)
    if not adapter.enabled:
        return output
    return output + adapter(inputs[0])


def _hidden_carries_gradients(embedding: nn.Module, inputs: Any, output: Any) -> Any:
    """The frozen embedding's output asks for a gradient while training.

    DeepSpeed's activation checkpoint (reentrant, as GPT-NeoX's) passes gradients into a recomputed block
    only through inputs that require them. With the embedding frozen, the hidden states entering the
    first checkpointed block require none, so that block's adapters silently got no gradient (selective
    recomputation left the single-rank curve) and with every block recomputed the loss had no gradient
    at all (DeepSpeed: "loss must be a scalar tensor"). PEFT asks the same of the input embeddings
    (``enable_input_require_grads``). The extra work is one gradient of the hidden states; no weight's
    gradient changes."""
    hidden = output[0] if isinstance(output, tuple) else output
    if torch.is_grad_enabled() and torch.is_floating_point(hidden) and not hidden.requires_grad:
        hidden.requires_grad_(True)
    return output


def check_targets(target_modules: Sequence[str]) -> None:
    unknown = sorted(set(target_modules) - set(TARGETS))
    if unknown or not target_modules:
        raise ConfigError(f"lora_target_modules={list(target_modules)!r}: choose among {sorted(TARGETS)}")


def apply_lora(model: nn.Module, config: LoRAArgs, seed: int) -> list[LoRAAdapter]:
    """Freeze ``model`` and attach an adapter to every targeted projection; returns the adapters.

    Works on a ``GPTModel`` and on a pipeline stage alike (targets are found by the last part of the
    module name, which the pipeline's layer indices do not change). A reward model's value head
    stays trainable: it is new, so there is no base to keep.
    """
    check_targets(config.lora_target_modules)
    model.requires_grad_(False)
    adapters = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in config.lora_target_modules and isinstance(module, TARGETS[leaf]):
            adapter = LoRAAdapter(module, config, seed)
            module.add_module(ADAPTER, adapter)
            module.register_forward_hook(_add_adapter_output)
            adapters.append(adapter)
        elif isinstance(module, ValueHead):  # also inside a pipeline's ValueHeadPipe
            module.requires_grad_(True)
        elif isinstance(module, GPTEmbedding):  # also a pipeline's EmbeddingPipe (first stage)
            module.register_forward_hook(_hidden_carries_gradients)
    return adapters  # may be empty on a pipeline stage without blocks


def adapters_of(model: nn.Module) -> list[LoRAAdapter]:
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter of ``model`` is skipped inside the block."""
    adapters = adapters_of(model)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def is_adapter_name(name: str) -> bool:
    return f".{ADAPTER}.lora_" in name or name.startswith(f"{ADAPTER}.lora_")


def adapter_product(a: torch.Tensor, b: torch.Tensor, sections: Sequence[int] | None) -> torch.Tensor:
    """``B A`` of one adapter, ``[out, in]``; a split adapter (``A`` ``[S r, in]``) multiplies each section's rows of
    ``B`` (``sections``: their sizes, in order) by its own ``A_s``: ``B`` block-diagonal."""
    r = b.shape[1]
    if a.shape[0] == r:
        return b @ a
    if sections is None or len(sections) * r != a.shape[0] or sum(sections) != b.shape[0]:
        raise ValueError(f"an adapter with A {tuple(a.shape)} and B {tuple(b.shape)} is split by sections: give "
                         f"the sizes of its layer's sections (got {sections})")
    return torch.cat([b_s @ a_s for b_s, a_s in zip(b.split(list(sections), 0), a.split(r, 0))], dim=0)


def merge_adapters(state: dict[str, torch.Tensor], scale: float,
                   sections: Callable[[str], Sequence[int] | None] = lambda weight: None) -> dict[str, torch.Tensor]:
    """A state dict (one tp rank's, or a full one) with every adapter folded into its layer's weight
    (``W + scale * B A``) and the adapter entries removed. ``sections(weight name)``: the row sections of a layer
    whose adapter is split by sections (``lora_split_fused``), in this state's sizes."""
    merged = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for key in state:
        if key.endswith(f".{ADAPTER}.lora_A"):
            layer = key[: -len(f".{ADAPTER}.lora_A")]
            a, b = state[key].float(), state[f"{layer}.{ADAPTER}.lora_B"].float()
            weight = merged[f"{layer}.weight"]
            delta = adapter_product(a, b, sections(f"{layer}.weight"))
            merged[f"{layer}.weight"] = (weight.float() + scale * delta).to(weight.dtype)
    return merged
