"""How the model and the batch are split over ranks: pipeline, tensor and sequence parallelism.

Data parallelism is whatever is left of the world size; it is derived, not configured.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup


class ParallelismArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsParallelism`` group."""

    pipe_parallel_size: int = Field(0, ge=0)
    """Number of pipeline stages; 0 builds a plain module without DeepSpeed's PipelineModule, 1 a
    one-stage pipeline."""

    model_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel degree: each attention/MLP weight is split across this many ranks."""

    pipe_partition_method: str = "type:transformer|mlp"
    """How layers are spread over pipeline stages, passed to DeepSpeed's PipelineModule
    (`parameters`, `uniform`, `type:<regex>`)."""

    world_size: int | None = Field(None, ge=1)
    """Total number of ranks; filled in at launch, not meant to be set in a config."""

    is_pipe_parallel: bool = False
    """Whether the model runs as a DeepSpeed pipeline; derived from pipe_parallel_size."""

    context_parallel_size: int = Field(1, ge=1)
    """Deepy addition (Megatron-LM's key): split each sequence over this many ranks (all-to-all over
    attention heads, DeepSpeed-Ulysses style); they count as data-parallel ranks to ZeRO."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    sharding_strategy: Literal["fsdp", "hsdp", "ddp"] | None = None
    """fms-fsdp's names for the data-parallel layout: fsdp = ZeRO-3 over every rank; hsdp = ZeRO-3
    whose parameter all-gathers stay inside a node (DeepSpeed ZeRO++ hpZ, zero_hpz_partition_size =
    ranks per node unless zero_optimization gives it); ddp = plain data parallel (ZeRO stage 0)."""
