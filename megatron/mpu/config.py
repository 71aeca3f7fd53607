"""How one run is split over ranks: the typed view of the parallelism keys.

Built once per rank from the validated arguments (``ParallelConfig.from_args``) and handed to
``megatron.initialize`` and the engine builder; nothing below reads the flat argument object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron.config_rules import RuleContext, rule

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
            partition_method=args.pipe_partition_method,
            world_size=args.world_size,
            backend=args.distributed_backend,
            master_addr=args.master_addr,
            master_port=args.master_port,
            prefer_slurm=args.deepspeed_slurm,
        )


@rule
def context_parallel_fits(ctx: RuleContext) -> list[str]:
    """What context parallelism (all-to-all over heads, megatron/mpu/context_parallel.py) can split."""
    from megatron.training.objectives.registry import needs_of

    cp = ctx.cp
    if cp == 1:
        return []
    shown, problems = ctx.show("context_parallel_size"), []
    seq = ctx.get("seq_length")
    if isinstance(seq, int) and seq % cp:
        problems.append(f"{shown} does not divide {ctx.show('seq_length')}: each rank holds seq_length / "
                        f"context_parallel_size tokens of every sequence")
    heads, kv = ctx.get("num_attention_heads"), ctx.get("num_kv_heads") or ctx.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(kv, int) and (heads % (ctx.tp * cp) or kv % (ctx.tp * cp)):
        problems.append(f"{shown}: the all-to-all gives each of the {ctx.tp * cp} ranks of model_parallel_size x "
                        f"context_parallel_size a share of the heads; {ctx.show('num_attention_heads')} and "
                        f"num_kv_heads ({kv}) must both be multiples of {ctx.tp * cp}")
    if needs_of(str(ctx.get("train_impl") or "normal")).dataset != "lm":
        problems.append(f"{shown} with {ctx.show('train_impl')}: context parallelism splits language-modelling "
                        "and SFT sequences only; set context_parallel_size: 1")
    if ctx.get("sequence_parallel"):
        problems.append(f"{shown} with {ctx.show('sequence_parallel')} is not supported yet: use one of them")
    if ctx.get("pos_emb") == "rpe":
        problems.append(f"{shown} with {ctx.show('pos_emb')} is not supported yet (the learned per-head biases "
                        "are not split with the heads): use rotary, ALiBi, learned or sinusoidal positions")
    if int(ctx.get("moe_num_experts") or 1) > 1:
        problems.append(f"{shown} with {ctx.show('moe_num_experts')} is not supported yet")
    return problems
