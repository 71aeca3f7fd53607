"""The keys of the weight average (``model_averaging.py``), apart from it so the launcher reads them without torch."""

from __future__ import annotations

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup


class ModelAveragingArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): an average of the weights kept beside them (Levanter's
    ``trainer.model_averaging``)."""

    ema_beta: float | None = Field(None, ge=0.0, le=1.0)
    """Keep an exponential moving average of the weights, ``ema = beta * ema + (1 - beta) * weights`` after
    every step (no bias correction, Levanter's ``type: ema``; 0.999 is its default); validation and test
    report ``eval/ema/<metric>`` beside ``eval/<metric>``, eval_tasks run on the average, and checkpoints
    store it (``deepy_ema/``). None: no average."""


@rule
def averaging_layouts(ctx: RuleContext) -> list[str]:
    """The average is written by data-parallel rank 0 (under ZeRO-3 after a gather over the partitions): experts
    split over data-parallel ranks differ between them."""
    if ctx.get("ema_beta") is None:
        return []
    problems = []
    if int(ctx.get("moe_expert_parallel_size") or 1) > 1:
        problems.append(f"{ctx.show('ema_beta')} with {ctx.show('moe_expert_parallel_size')}: experts split over "
                        "data-parallel ranks differ between them, and the average is saved from data-parallel rank 0 "
                        "only; use moe_expert_parallel_size: 1")
    return problems
