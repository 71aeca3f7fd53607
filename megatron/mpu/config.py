"""How one run is split over ranks: the typed view of the parallelism keys.

Built once per rank from the validated arguments (``ParallelConfig.from_args``) and handed to
``megatron.initialize`` and the engine builder; nothing below reads the flat argument object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal


if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

Backend = Literal["nccl", "gloo", "mpi"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel degree (``model_parallel_size``)."""
    pipe: int = 0
    """Pipeline stages (``pipe_parallel_size``); 0 = a plain module, >= 1 = DeepSpeed PipelineModule."""
    sequence_parallel: bool = False
    context: int = 1
    """``context_parallel_size``: each sequence split over this many ranks (``megatron/mpu/context_parallel.py``)."""
    expert: int = 1
    """``moe_expert_parallel_size``: experts split over this many data-parallel ranks (1 = not split)."""
    sharding_group_size: int | None = None
    """``sharding_group_size`` of ``sharding_strategy: hsdp``: data-parallel ranks per ZeRO-3 shard group
    (``megatron/mpu/hybrid_shard.py``); None = no hybrid sharding."""
    partition_method: str = "type:transformer|mlp"
    """GPT-NeoX's ``pipe_partition_method``."""
    world_size: int | None = None
    """The world size deepy.py checked the config for; the ranks verify it at start-up."""
    backend: Backend | None = None
    """``distributed_backend``; None = nccl with CUDA, gloo without."""
    master_addr: str | None = None
    master_port: int | None = None
    prefer_slurm: bool = False
    """``deepspeed_slurm``: take rank/world from Slurm's environment (srun started the ranks)."""

    @property
    def is_pipe(self) -> bool:
        return self.pipe >= 1

    @property
    def stages(self) -> int:
        """Pipeline stages counting a plain module as one."""
        return max(self.pipe, 1)

    @classmethod
    def from_args(cls, args: NeoXArgs) -> ParallelConfig:
        return cls(
            tensor=args.model_parallel_size,
            pipe=args.pipe_parallel_size,
            sequence_parallel=args.sequence_parallel,
            context=args.context_parallel_size,
            expert=args.moe_expert_parallel_size,
            sharding_group_size=args.sharding_group_size,
            partition_method=args.pipe_partition_method,
            world_size=args.world_size,
            backend=args.distributed_backend,
            master_addr=args.master_addr,
            master_port=args.master_port,
            prefer_slurm=args.deepspeed_slurm,
        )
