"""The keys of the weight average (``model_averaging.py``), apart from it so the launcher reads them without torch."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from megatron.config_rules import RuleContext, block_enabled, rule, zero_stage
from megatron.config_schema import ArgGroup


class ModelAveragingArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): an average of the weights kept beside them (Levanter's
    ``trainer.model_averaging``)."""

    ema_beta: float | None = Field(None, ge=0.0, le=1.0)
    """Keep an exponential moving average of the weights, ``ema = beta * ema + (1 - beta) * weights`` after
    every step (no bias correction, Levanter's ``type: ema``; 0.999 is its default); validation and test
    report ``eval/ema/<metric>`` beside ``eval/<metric>``, eval_tasks run on the average, and checkpoints
    store it (``deepy_ema/``). None: no average."""


HALF = ("fp16", "bfloat16", "bf16")


@rule
def averaging_layouts(ctx: RuleContext) -> list[str]:
    """The average is written by data-parallel rank 0 (under ZeRO-3 after a gather over the partitions): experts
    split over data-parallel ranks differ between them. Under ZeRO-3 it reads each rank's partitions in memory,
    which parameters offloaded to NVMe are not between steps - nor, under bf16/fp16, the fp32 master partitions
    the average follows when the optimizer is offloaded to NVMe."""
    if ctx.get("ema_beta") is None:
        return []
    problems = []
    block = ctx.get("zero_optimization")

    def on_nvme(key: str) -> bool:
        offload = block.get(key) if isinstance(block, Mapping) else None
        return isinstance(offload, Mapping) and str(offload.get("device", "none")).lower() == "nvme"

    if zero_stage(ctx) >= 3 and on_nvme("offload_param"):
        problems.append(f"{ctx.show('ema_beta')} with zero_optimization.offload_param.device nvme: the average reads "
                        "each rank's parameter partitions in memory, which NVMe offload swaps out; offload them to "
                        "cpu, or set ema_beta: null")
    half = block_enabled(ctx.get("bf16")) or block_enabled(ctx.get("fp16")) or ctx.get("precision") in HALF
    if zero_stage(ctx) >= 3 and half and on_nvme("offload_optimizer"):
        problems.append(f"{ctx.show('ema_beta')} with zero_optimization.offload_optimizer.device nvme: under "
                        f"{ctx.get('precision')} the average follows each rank's fp32 master partitions, which NVMe "
                        "offload swaps out between steps; offload the optimizer to cpu, or set ema_beta: null")
    if int(ctx.get("moe_expert_parallel_size") or 1) > 1:
        problems.append(f"{ctx.show('ema_beta')} with {ctx.show('moe_expert_parallel_size')}: experts split over "
                        "data-parallel ranks differ between them, and the average is saved from data-parallel rank 0 "
                        "only; use moe_expert_parallel_size: 1")
    return problems
