"""How the model and the batch are split over ranks: pipeline, tensor and sequence parallelism.

Data parallelism is whatever is left of the world size; it is derived, not configured.

Declared here, beside the process groups that read them (``megatron/initialize.py`` builds the groups
of ``megatron/mpu/topology.py`` from them); the one argument object (``NeoXArgs``) is composed of this
class. Start-up also reads keys declared with their owners (the expert split with the MoE keys, the
backend and the Slurm switch with the process keys, the rendezvous with DeepSpeed's runner keys):
:class:`ParallelRun` holds everything it reads as plain values, built once above (``RunConfig.parallel``)
and handed to each rank's start-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup


Backend = Literal["nccl", "gloo", "mpi"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelRun:
    """Everything a rank's start-up and the model builder read to split the run over ranks: the
    parallelism keys (:class:`ParallelismArgs`) and the shared ones declared by their owners, as plain
    values resolved once above (``RunConfig.parallel``)."""

    model_parallel_size: int
    """Tensor-parallel degree."""
    pipe_parallel_size: int
    """Pipeline stages as configured (0: a plain module)."""
    pipe_stages: int
    """Pipeline stages, counting a plain module as one (:attr:`ParallelismArgs.pipe_stages`)."""
    uses_pipeline_module: bool
    """Built as DeepSpeed's PipelineModule (:attr:`ParallelismArgs.uses_pipeline_module`)."""
    pipe_partition_method: str
    """How layers are spread over the pipeline stages."""
    context_parallel_size: int
    """Ranks each sequence is split over."""
    world_size: int | None
    """Total ranks, as the launch recorded it (None: not recorded)."""
    sharding_group_size: int | None
    """Data-parallel ranks per ZeRO-3 shard group (``sharding_strategy: hsdp``); None: no hybrid sharding."""
    sequence_parallel: bool
    """Activations split over the tensor-parallel ranks between layers (the model's key)."""
    moe_expert_parallel_size: int
    """Ranks the experts are split over (the MoE keys')."""
    distributed_backend: Backend | None
    """torch.distributed backend (the process keys'); None: the device's default."""
    master_addr: str | None
    """Rendezvous address (DeepSpeed runner's key)."""
    master_port: int
    """Rendezvous port (DeepSpeed runner's key)."""
    deepspeed_slurm: bool
    """Read the rank layout from Slurm's variables (DeepSpeed runner's key)."""


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

    @property
    def uses_pipeline_module(self) -> bool:
        """Whether the model is built as DeepSpeed's PipelineModule (``pipe_parallel_size >= 1``)."""
        return self.pipe_parallel_size >= 1

    @property
    def pipe_stages(self) -> int:
        """Pipeline stages, counting a plain module (``pipe_parallel_size: 0``) as one."""
        return max(self.pipe_parallel_size, 1)

    # ---- Deepy extras (not in GPT-NeoX) ----

    sharding_strategy: Literal["fsdp", "hsdp", "ddp"] | None = None
    """fms-fsdp's names for the data-parallel layout: fsdp = ZeRO-3 over every data-parallel rank;
    hsdp = hybrid sharding, ZeRO-3 within groups of sharding_group_size ranks (a node) and those
    groups replicated across nodes, gradients averaged over the replicas once per step (each rank
    holds 1/sharding_group_size of the model states; Deepy's own groups, megatron/mpu/hybrid_shard.py,
    since DeepSpeed 0.19.8 removed MiCS and ZeRO++ hpZ keeps every rank's shard at 1/dp);
    ddp = plain data parallel (ZeRO stage 0)."""

    sharding_group_size: int | None = Field(None, ge=1)
    """Data-parallel ranks per ZeRO-3 shard group with sharding_strategy: hsdp (torch/llama-recipes'
    name); must divide the data-parallel size. Default: the ranks of one node (num_gpus, or every rank
    of a launch on this machine alone; a multi-node launch without num_gpus must set it)."""


PARTITION_NAMES = ("type:transformer|mlp", "type:transformer", "type:transformerlayerpipe", "parameters", "uniform")
"""GPT-NeoX's ``pipe_partition_method`` names (``engine/build.py`` maps the ``type:`` ones onto the blocks of
every layer family); any other ``type:<regex>`` goes to DeepSpeed's PipelineModule as it is."""


def partition_method_problem(method: str, shown: str | None = None) -> str | None:
    """Why DeepSpeed's PipelineModule cannot partition by ``method`` (the key as ``shown``), or None (the ranks and
    the check before launch ask the same)."""
    shown = shown or f"pipe_partition_method={method!r}"
    if method.lower() in PARTITION_NAMES:
        return None
    if method.startswith("type:"):
        try:
            re.compile(method.removeprefix("type:"), re.IGNORECASE)  # DeepSpeed searches the layer names with it
        except re.error as err:
            return f"{shown}: the regex after type: does not compile ({err})"
        return None
    return (f"{shown} is not known; use one of {sorted(PARTITION_NAMES)} "
            f"or type:<regex over layer class names>")


@rule
def pipe_partition_method_known(ctx: RuleContext) -> list[str]:
    """The partition a pipeline engine is built with (``pipe_parallel_size`` 1 or more)."""
    if not ctx.uses_pipeline_module:
        return []
    problem = partition_method_problem(str(ctx.get("pipe_partition_method")), ctx.show("pipe_partition_method"))
    return [] if problem is None else [problem]
