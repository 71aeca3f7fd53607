"""What one rank holds of its model partition once DeepSpeed 0.19.8 has wrapped the optimizer: weights,
gradients, fp32 master weights and optimizer states, in elements and bytes, padding included.

The rehearsal (``deepy.py --rehearse N``, megatron/app/rehearsal.py) hands in the parameters of a partition it
built (the trainable ones in the optimizer's groups, as ``optimizers.param_groups`` makes them, and the frozen
rest); the memory estimate (megatron/engine/memory.py) asks the same question about the optimizer DeepSpeed
builds. Read from DeepSpeed 0.19.8 (``.venv/lib/python3.11/site-packages/deepspeed``):

* which optimizer: ``DeepSpeedEngine._do_optimizer_sanity_check`` (runtime/engine.py:2294-2325), see
  :func:`deepspeed_optimizer`;
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``, runtime/zero/stage_1_and_2.py:430-590) and the bf16 optimizer
  (``BF16_Optimizer``, runtime/bf16_optimizer.py:152-226) flatten each parameter group, pad the flat buffer to a
  multiple of ``nccl_start_alignment_factor x dp`` (``2 x dp``: "4-byte alignment/sizeof(fp16)",
  stage_1_and_2.py:387, bf16_optimizer.py:102) with DeepSpeed's ``align_dense_tensors`` (runtime/utils.py:994,
  called here on the partition's meta tensors) and give each data-parallel rank ``padded / dp`` consecutive
  elements (``get_data_parallel_partitions``, stage_1_and_2.py:2559; bf16_optimizer.py:174). Frozen parameters
  are not in the flat buffers (``is_optimized_parameter``) and stay whole on every rank;
* ZeRO-3 (runtime/zero/partition_parameters.py:1690-1696, ``_aligned_size``/``_padding_size``) pads each
  parameter, frozen ones too, to a multiple of the partition group's size and gives each rank ``ceil(n / dp)``
  of it. Restated here because those are methods of ``deepspeed.zero.Init``, which partitions real tensors
  while the model is built; the arithmetic is two lines.

What each optimizer keeps (``P`` the partition's parameters, ``T`` its trainable ones, ``w`` bytes per weight,
``a`` per accumulated gradient, ``k`` optimizer state tensors, ``[x]`` this rank's ZeRO part of ``x``):

================  ===========================  =================================  ================  ===================
optimizer         weights                      gradients                          master weights    optimizer states
================  ===========================  =================================  ================  ===================
none (fp32)       4P                           4T                                 (the weights)     4kT
fp16, bf16 (DDP)  wP                           wT                                 4T                4kT
bf16 optimizer    w(padded T + frozen)         a x padded T + wT (whole buffers)  4[T]              4k[T]
ZeRO-1            w(padded T + frozen)         wT (reduced after the backward)    m[T]              s k[T]
ZeRO-2            w(padded T + frozen)         a[T]                               m[T]              s k[T]
ZeRO-3            w([P] + persistent)          a[T]                               m[T]              s k[T]
================  ===========================  =================================  ================  ===================

(``m``, ``s``: 2 with the bf16 block's ``bf16_master_weights_and_grads``/``bf16_optimizer_states``, else 4; with
``offload_optimizer`` the master weights and states are in CPU memory.)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the memory estimate imports this module before launch, without torch
    import torch

OptimizerWrapper = Literal["none", "fp16", "bf16_ddp", "bf16", "zero"]
"""DeepSpeed's names: no wrapper, ``FP16``, ``DDP_BFLOAT16`` (both ``FP16_Optimizer``), ``BFLOAT16``
(``BF16_Optimizer``), ``ZERO_OPTIMIZATION``."""

WRAPPER_NAMES: dict[OptimizerWrapper, str] = {
    "none": "nothing (fp32 without ZeRO: the optimizer itself)",
    "fp16": "FP16_UnfusedOptimizer (fp16; FP16_Optimizer around DeepSpeed's FusedAdam)",
    "bf16_ddp": "FP16_UnfusedOptimizer in bf16",
    "bf16": "BF16_Optimizer",
    "zero": "DeepSpeedZeroOptimizer (DeepSpeedZeroOptimizer_Stage3 at stage 3)",
}
"""The class DeepSpeed builds for each wrapper (engine.py:2357-2366, :2555-2610; Deepy hands it torch's AdamW,
not DeepSpeed's FusedAdam, so fp16 and bf16 without ZeRO get the unfused one)."""

ALIGNMENT_FACTOR = 2
"""``nccl_start_alignment_factor``: a ZeRO-1/2 or bf16 flat buffer is padded to a multiple of this times dp."""


def deepspeed_optimizer(precision: str, zero_stage: int, pipeline: bool, grad_accum_bytes: int | None,
                        offload: bool) -> OptimizerWrapper:
    """The optimizer wrapper DeepSpeed 0.19.8 builds (``_do_optimizer_sanity_check``, runtime/engine.py:2294):
    under ZeRO, the bf16 optimizer for bf16 weights with fp32 gradient accumulation at stage 1 without
    offload, else ZeRO's; without ZeRO, nothing for fp32, the bf16 optimizer for a bf16 pipeline, else
    ``FP16_Optimizer`` (fp16, or bf16 without a pipeline). Restated: DeepSpeed decides inside its engine's
    constructor, after the model and the process groups exist."""
    if zero_stage > 0:
        return "bf16" if precision == "bf16" and grad_accum_bytes == 4 and zero_stage == 1 and not offload else "zero"
    if precision == "fp32":
        return "none"
    if precision == "bf16":
        return "bf16" if pipeline else "bf16_ddp"
    return "fp16"


def flat_partition(params: Sequence[torch.Tensor], dp: int) -> tuple[int, int]:
    """(padded elements of the flat buffer, elements each rank owns) of one parameter group under ZeRO-1/2 or the
    bf16 optimizer: DeepSpeed's own padding (``align_dense_tensors``) of ``params`` (meta tensors will do)."""
    # lazy: DeepSpeed; the dry run's estimate counts without it
    from deepspeed.runtime.utils import align_dense_tensors

    if not params:
        return 0, 0
    padded = sum(t.numel() for t in align_dense_tensors(list(params), ALIGNMENT_FACTOR * dp))
    return padded, padded // dp


def zero3_partition(numel: int, dp: int) -> int:
    """Elements of one parameter each rank owns under ZeRO-3: ``numel`` padded to a multiple of ``dp``, over dp
    (``_aligned_size // _partition_world_size``, partition_parameters.py:1690-1702 and :1816-1817)."""
    return (numel + (-numel) % dp) // dp


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """The byte sizes and counts the holdings depend on (``MemoryLayout``'s fields of the same meaning)."""

    precision: str
    zero_stage: int
    pipeline: bool
    grad_accum_bytes: int | None
    offload: bool
    optimizer_states: int
    master_bytes: int = 4
    state_bytes: int = 4
    persistence_threshold: int = 100_000
    """ZeRO-3 keeps a parameter of at most this many elements whole on every rank besides its part
    (``stage3_param_persistence_threshold``, default 1e5: zero/config.py:228, parameter_offload.py:317-329)."""
    model_persistence_threshold: int = sys.maxsize
    """... as long as the whole ones add up to at most this (``stage3_model_persistence_threshold``)."""

    @property
    def wrapper(self) -> OptimizerWrapper:
        return deepspeed_optimizer(self.precision, self.zero_stage, self.pipeline, self.grad_accum_bytes, self.offload)

    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES[self.precision]

    @property
    def accum_bytes(self) -> int:
        return self.grad_accum_bytes or self.weight_bytes


WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each ``precision`` (the memory estimate reads it too)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Elements:
    """One rank's parameters as its optimizer lays them out."""

    trainable: int
    frozen: int
    padded: int
    """Trainable elements with DeepSpeed's padding: the flat buffers of ZeRO-1/2 and the bf16 optimizer (each
    group padded to ``2 x dp``), ZeRO-3's parameters (each padded to ``dp``); ``trainable`` otherwise."""
    owned: int
    """This rank's ZeRO part of ``padded`` (``padded / dp``); ``trainable`` without a partitioning optimizer."""
    frozen_owned: int
    """This rank's part of the frozen parameters: ZeRO-3 partitions them too; whole otherwise."""
    persistent: int
    """ZeRO-3: elements of the parameters kept whole on every rank (below the persistence threshold)."""


def elements(groups: Sequence[Sequence[torch.Tensor]], params: Sequence[torch.Tensor], dp: int,
             how: Precision) -> Elements:
    """How the optimizer ``how`` names lays out a partition whose optimizer groups are ``groups`` and whose
    parameters, in the model's order, are ``params``, over a ZeRO group of ``dp`` ranks."""
    trainable_ids = {id(t) for group in groups for t in group}
    trainable = sum(t.numel() for group in groups for t in group)
    frozen_params = [t for t in params if id(t) not in trainable_ids]
    frozen = sum(t.numel() for t in frozen_params)
    if how.wrapper in ("none", "fp16", "bf16_ddp"):
        return Elements(trainable=trainable, frozen=frozen, padded=trainable, owned=trainable, frozen_owned=frozen,
                        persistent=0)
    if how.zero_stage == 3:
        owned = sum(zero3_partition(t.numel(), dp) for group in groups for t in group)
        persistent = whole = 0
        for t in params:  # DeepSpeed's walk over module.named_parameters() (parameter_offload.py:321-329)
            if t.numel() + whole > how.model_persistence_threshold:
                continue
            if t.numel() <= how.persistence_threshold:
                persistent += t.numel()
                whole += t.numel()
        return Elements(trainable=trainable, frozen=frozen, padded=owned * dp, owned=owned,
                        frozen_owned=sum(zero3_partition(t.numel(), dp) for t in frozen_params),
                        persistent=persistent)
    flat = [flat_partition(group, dp) for group in groups]
    return Elements(trainable=trainable, frozen=frozen, padded=sum(p for p, _ in flat), owned=sum(o for _, o in flat),
                    frozen_owned=frozen, persistent=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """What one rank holds of its partition, in bytes (the table of the module docstring)."""

    parameters: int
    """Parameters of the partition the rank built (tp shard of its stage), before any ZeRO partitioning."""
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    offloaded: bool = False
    """Master weights and states are in CPU memory (``offload_optimizer``)."""


def holding(e: Elements, how: Precision) -> Holding:
    """What a rank holds, by the optimizer DeepSpeed builds (the table of the module docstring)."""
    w, a, k = how.weight_bytes, how.accum_bytes, how.optimizer_states
    params = e.trainable + e.frozen
    wrapper = how.wrapper
    if wrapper in ("none", "fp16", "bf16_ddp"):
        master = 0 if wrapper == "none" else 4 * e.trainable
        return Holding(parameters=params, weights=w * params, gradients=w * e.trainable, master_weights=master,
                       optimizer_states=4 * k * e.trainable)
    if wrapper == "bf16":
        # BF16_Optimizer: a whole gradient buffer (padded, grad_accum_dtype) besides the backward's own bf16
        # gradients; fp32 master and states over this rank's part (bf16_optimizer.py:182, :190)
        return Holding(parameters=params, weights=w * (e.padded + e.frozen), gradients=a * e.padded + w * e.trainable,
                       master_weights=4 * e.owned, optimizer_states=4 * k * e.owned)
    if how.zero_stage == 3:
        weights = w * (e.owned + e.frozen_owned + e.persistent)
    else:
        weights = w * (e.padded + e.frozen)
    gradients = w * e.trainable if how.zero_stage == 1 else a * e.owned  # ZeRO-1 reduces after the backward
    return Holding(parameters=params, weights=weights, gradients=gradients, master_weights=how.master_bytes * e.owned,
                   optimizer_states=how.state_bytes * k * e.owned, offloaded=how.offload)
