"""The learning-rate schedule: warmup, decay shape and floor, plus Levanter's cycles and
warmup-stable-decay.

The schedule itself is a pure function of the step (``megatron/training/lr_schedules.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.neox_arguments.schema import ArgGroup

DecayStyle = Literal["constant", "linear", "cosine", "exponential", "inv_sqrt", "inv", "wsd"]


class LRSchedulerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsLRScheduler`` group."""

    lr_decay_style: DecayStyle = "linear"
    """Shape of the decay after warmup: NeoX's constant/linear/cosine/exponential, or Levanter's
    inv_sqrt, inv and wsd (warmup-stable-decay)."""

    lr_decay_iters: int | None = Field(None, ge=0)
    """Number of steps over which the rate decays; defaults to train_iters."""

    lr_decay_fraction: float | None = Field(None, gt=0, le=1)
    """Decay over this fraction of train_iters instead of giving lr_decay_iters."""

    min_lr: float = Field(0.0, ge=0)
    """Floor the learning rate never decays below."""

    warmup: float = Field(0.01, ge=0)
    """Linear warmup length: a fraction of the decay steps when below 1, otherwise a number of
    steps."""

    override_lr_scheduler: bool = False
    """On resume, ignore the schedule stored in the checkpoint and use this config's values."""

    use_checkpoint_lr_scheduler: bool = False
    """On resume, take schedule values from the checkpoint even if the config differs."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    cycles: int | list[int] | None = None
    """Split training into this many equal LR cycles, or a list of the steps at which new cycles
    begin (Levanter)."""

    cycle_length: int | None = Field(None, ge=1)
    """Length of every LR cycle in steps, instead of giving cycles."""

    rewarmup: float = Field(0.0, ge=0)
    """Warmup of every cycle after the first, from min_lr back to the peak: a fraction of the cycle
    when below 1, otherwise steps."""

    min_lr_ratio: float | None = Field(None, ge=0, le=1)
    """Floor of the schedule as a fraction of lr; an alternative to min_lr."""

    decay_fraction: float | None = Field(None, gt=0, le=1)
    """Share of each cycle spent decaying (wsd: the cooldown); the rest after warmup stays at the
    peak."""
