"""The keys of the weight average (``model_averaging.py``), apart from it so the launcher reads them without torch."""

from __future__ import annotations

from pydantic import Field

from megatron.config_rules import RuleContext, rule, zero_stage
from megatron.config_schema import ArgGroup


class ModelAveragingArgs(ArgGroup):
    """Deepy's own group: an average of the weights kept beside them (Levanter's ``trainer.model_averaging``)."""

    ema_beta: float | None = Field(None, ge=0.0, le=1.0)
    """Keep an exponential moving average of the weights, ``ema = beta * ema + (1 - beta) * weights`` after
    every step (no bias correction, Levanter's ``type: ema``; 0.999 is its default); validation and test
    report ``eval/ema/<metric>`` beside ``eval/<metric>``, eval_tasks run on the average, and checkpoints
    store it (``deepy_ema/``). None: no average."""


@rule
def averaging_layouts(ctx: RuleContext) -> list[str]:
    """The average copies each rank's module parameters; ZeRO-3 leaves a rank only a partition of them."""
    if ctx.get("ema_beta") is None or zero_stage(ctx) < 3:
        return []
    return [f"{ctx.show('ema_beta')} with zero_optimization.stage 3: ZeRO-3 partitions the module's parameters, "
            "and an average of a partition is not built here; use stage 1 or 2 (ZeRO-1/2 keep the whole module on "
            "every rank)"]
