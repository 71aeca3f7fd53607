"""Skipping a step whose loss or gradient norm is far above the recent ones: Levanter's ``skip_bad_steps``.

Levanter's rule (``src/levanter/optim/skipstep.py`` at stanford-crfm/levanter 9263f81e, ``SkipStepConfig``
and its ``wrap``; after OLMo-core's skip-step optimizer): a rolling window of the last
``rolling_interval_length`` (default 128) steps' loss and gradient norm - the global L2 norm of the raw
gradients, before clipping (the wrapper sits outside ``clip_by_global_norm``, ``optim/config.py``
``AdamConfig.build``). Before a step, from the window *without* it:
``threshold = mean + sigma_factor * max(std, 1e-6)`` (population std over the window's entries, sigma 6.0
by default), for the loss and the norm alike; the step is skipped when ``loss <= threshold`` or
``norm <= threshold`` fails (so a NaN is skipped) and the window already holds at least
``max(2, rolling_interval_length // 2)`` entries. The step's loss and norm then enter the window whether it
was skipped or not. A skipped step applies no update (weight decay included) and leaves the optimizer's
own state (Adam's moments and step count) as it was; the learning-rate schedule still advances
(its count lives in ``optax.inject_hyperparams``, outside the wrapper), and so do the trainer's step,
the data and the weight average. ``skip_bad_steps: true`` is the default window, an integer is the
window's length.

Here the decision is made inside the optimizer step, where DeepSpeed has computed the gradient norm
(``training/skip_gate.py``); the rule itself is :class:`BadStepRule`, pure arithmetic, saved with
the loop's state in every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup


class BadStepArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): Levanter's ``optimizer.skip_bad_steps``."""

    skip_bad_steps_window: int | None = Field(None, ge=1)
    """Skip a step whose loss or raw gradient norm exceeds the mean + skip_bad_steps_sigma standard deviations of
    the last this many steps (once half of them are known); a skipped step changes no weight and no
    optimizer moment, and the LR schedule moves on. Levanter's skip_bad_steps (true = 128). None: never skip."""

    skip_bad_steps_sigma: float = Field(6.0, gt=0)
    """How many standard deviations above the window's mean a loss or gradient norm may be (Levanter's
    sigma_factor); read with skip_bad_steps_window."""

    def bad_step_rule(self) -> BadStepRule | None:
        """The rule these keys ask for; None without a window."""
        if self.skip_bad_steps_window is None:
            return None
        return BadStepRule(self.skip_bad_steps_window, self.skip_bad_steps_sigma)


@rule
def bad_step_keys(ctx: RuleContext) -> list[str]:
    """The sigma means nothing without the window; the pipeline's step runs before its loss is known here."""
    if ctx.get("skip_bad_steps_window") is None:
        if ctx.given("skip_bad_steps_sigma"):
            return [f"{ctx.show('skip_bad_steps_sigma')} without skip_bad_steps_window: set the window (Levanter's "
                    "rolling_interval_length, 128) or remove the sigma"]
        return []
    if int(ctx.get("pipe_parallel_size") or 0) >= 1:
        return [f"{ctx.show('skip_bad_steps_window')} with {ctx.show('pipe_parallel_size')}: DeepSpeed's pipeline "
                "engine applies the update inside its schedule, before the step's loss reaches the rule; use "
                "pipe_parallel_size: 0 (tensor parallelism and ZeRO work)"]
    return []


@dataclass(frozen=True)
class Verdict:
    skip: bool
    loss_threshold: float
    norm_threshold: float


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@dataclass
class BadStepRule:
    """The last ``window`` steps' (loss, gradient norm) and the decision for the next step."""

    window: int
    sigma: float = 6.0
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    skipped: int = 0
    """Steps skipped so far in the run."""

    def judge(self, loss: float, norm: float) -> Verdict:
        """Whether a step with this loss and norm is skipped; then the pair joins the window."""
        loss_mean, loss_std = _mean_std(self.losses)
        norm_mean, norm_std = _mean_std(self.norms)
        loss_threshold = loss_mean + self.sigma * max(loss_std, 1e-6)
        norm_threshold = norm_mean + self.sigma * max(norm_std, 1e-6)
        enough = len(self.losses) >= max(2, self.window // 2)
        skip = enough and not (loss <= loss_threshold and norm <= norm_threshold)
        self.losses = (self.losses + [float(loss)])[-self.window:]
        self.norms = (self.norms + [float(norm)])[-self.window:]
        self.skipped += int(skip)
        return Verdict(skip, loss_threshold, norm_threshold)

    def to_dict(self) -> dict[str, Any]:
        return {"window": self.window, "losses": list(self.losses), "norms": list(self.norms), "skipped": self.skipped}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue a saved window (a resumed run); a saved window of another length keeps its newest entries."""
        if not saved:
            return
        self.losses = [float(v) for v in saved.get("losses", [])][-self.window:]
        self.norms = [float(v) for v in saved.get("norms", [])][-self.window:]
        self.skipped = int(saved.get("skipped", 0))
