"""The learning-rate schedule's keys: warmup, decay shape and floor, plus Levanter's cycles and
warmup-stable-decay.

Declared here, beside the schedule that reads them; the one argument object (``NeoXArgs``) is
composed of this class, and the trainer hands the schedule that object (typed as this class).
:meth:`LRSchedulerArgs.spec` turns the keys into the :class:`ScheduleSpec` the schedule evaluates
(``megatron/engine/lr_schedules.py``), once the steps and the peak rate are known. The checks of
these keys before launch are here too, the comparison of a resumed checkpoint's schedule with the
config's among them (:func:`schedule_problems`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pydantic import Field, field_validator

from megatron import plugins
from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup
from megatron.engine.optimizer_config import peak_lr_setting
from megatron.errors import ConfigError
from megatron.engine import lr_dialects as _dialects  # noqa: F401  # registers Levanter's and fms-fsdp's styles
from megatron.engine.lr_neox import NEOX_STYLES, decay_steps
from megatron.engine.lr_schedules import (
    SchedulePolicy,
    ScheduleSpec,
    cycle_starts_for,
    min_lr_problem,
    spec_differences,
    steps_of,
)

if TYPE_CHECKING:
    from megatron.checkpointing.resume_checks import Start


class LRSchedulerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsLRScheduler`` group."""

    lr_decay_style: str = "linear"
    """Shape of the decay after warmup, a registered schedule plug-in (``megatron/engine/lr_schedules.py``):
    NeoX's constant/linear/cosine/exponential, or Levanter's inv_sqrt, inv and wsd
    (warmup-stable-decay)."""

    @field_validator("lr_decay_style")
    @classmethod
    def _registered_schedule(cls, value: str) -> str:
        return plugins.validate_name("lr_decay_style", value)

    lr_decay_iters: int | None = Field(None, ge=0)
    """Number of steps over which the rate decays; defaults to train_iters. Wins over
    lr_decay_fraction, as in GPT-NeoX's code."""

    lr_decay_fraction: float | None = Field(None, gt=0, le=1)
    """Decay over floor(lr_decay_fraction x train_iters) steps when lr_decay_iters is not given."""

    min_lr: float = Field(0.0, ge=0)
    """Floor of the rate: linear and exponential decay are cut at it, cosine decays onto it."""

    warmup: float = Field(0.01, ge=0)
    """Linear warmup over warmup x the decay steps (GPT-NeoX: lr x max(1, step) / that, a fraction of
    a step included); a whole number above 1 is a number of steps (a Deepy extension)."""

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

    def spec(self, train_iters: int, max_lr: float) -> ScheduleSpec:
        """GPT-NeoX semantics: ``warmup`` is a fraction of ``lr_decay_iters`` (default train_iters),
        ``min_lr`` an absolute floor; Deepy extras as documented on the keys."""
        style = plugins.get("lr_decay_style", self.lr_decay_style)
        if style.needs.get("whole_curve"):  # Levanter's and fms-fsdp's curves: the style computes every step
            names = style.keys.model_fields if style.keys else ()
            return ScheduleSpec(style=self.lr_decay_style, max_lr=max_lr, total_steps=train_iters,
                                options=tuple((key, getattr(self, key)) for key in names))
        if self.lr_decay_iters is None and train_iters < 1:
            raise ConfigError("the LR schedule needs lr_decay_iters or train_iters to be set (>= 1)")
        total = decay_steps(train_iters, self.lr_decay_iters, self.lr_decay_fraction)
        min_lr = max_lr * self.min_lr_ratio if self.min_lr_ratio is not None else self.min_lr
        starts = cycle_starts_for(total, self.cycles, self.cycle_length)
        later_len = (starts[2] - starts[1]) if len(starts) > 2 else (total - starts[-1])
        warmup_steps = steps_of(self.warmup, total)
        keys = style.keys
        return ScheduleSpec(
            style=self.lr_decay_style,
            max_lr=max_lr,
            min_lr=min_lr,
            total_steps=total,
            warmup_steps=warmup_steps,
            rewarmup_steps=steps_of(self.rewarmup, later_len) if len(starts) > 1 else 0,
            cycle_starts=starts,
            decay_fraction=self.decay_fraction,
            # inv/inv_sqrt continue the warmup's slope: lr * sqrt(W / (W + t)) is the classic
            # inverse-square-root schedule when T is the warmup length
            timescale=float(max(warmup_steps, 1)),
            # a plug-in style's own keys, read from this same object (the composed arguments)
            options=tuple((key, getattr(self, key)) for key in (keys.model_fields if keys else ())),
        )

    @property
    def resume_policy(self) -> SchedulePolicy:
        """Whose schedule a resumed run follows when the checkpoint's differs from this config's."""
        if self.use_checkpoint_lr_scheduler:
            return "checkpoint"
        return "config" if self.override_lr_scheduler else "strict"


@rule
def warmup_in_range(ctx: RuleContext) -> list[str]:
    warmup = ctx.get("warmup")
    if warmup is None or 0 <= warmup <= 1:
        return []
    if warmup < 0:
        return [f"{ctx.show('warmup')} is negative: use a fraction in [0, 1] of the decay steps"]
    if float(warmup) != int(warmup):
        return [
            f"{ctx.show('warmup')} is neither a fraction in [0, 1] (GPT-NeoX: share of the decay "
            f"steps) nor a whole number of steps: write e.g. 0.01"
        ]
    iters = ctx.get("train_iters")
    if iters is not None and warmup > iters:
        return [f"{ctx.show('warmup')} steps is more than {ctx.show('train_iters')}: use a fraction in [0, 1]"]
    return []


@rule
def neox_curve_surprises(ctx: RuleContext) -> list[str]:
    """Two things GPT-NeoX's curve does that a config rarely means; Deepy follows it and says so."""
    style, iters = ctx.get("lr_decay_style"), ctx.get("train_iters")
    if style not in NEOX_STYLES or iters is None or ctx.get("cycles") or ctx.get("cycle_length") \
            or ctx.get("decay_fraction"):
        return []
    total = decay_steps(iters, ctx.get("lr_decay_iters"), ctx.get("lr_decay_fraction"))
    warmup = ctx.get("warmup") or 0.0
    steps = warmup * total if warmup <= 1 else float(int(warmup))
    if 0 < steps < 1:
        ctx.warnings.append(f"{ctx.show('warmup')} x {total} decay steps = {steps:g} steps: GPT-NeoX's warmup "
                            f"(lr x max(1, step) / {steps:g}) gives the first update {1 / steps:.3g} x lr, and "
                            f"so does Deepy; use warmup: 0 for none")
    if style == "cosine" and iters > total:
        ctx.warnings.append(f"{ctx.show('train_iters')} runs past the {total} decay steps: GPT-NeoX's cosine rises "
                            f"again after them, and so does Deepy's; set lr_decay_iters to train_iters to stop at min_lr")
    return []


SCHEDULE_KEYS = ("lr_decay_style", "lr_decay_iters", "lr_decay_fraction", "min_lr", "min_lr_ratio", "warmup", "cycles",
                 "cycle_length", "rewarmup", "decay_fraction")
"""The keys :meth:`LRSchedulerArgs.spec` reads besides train_iters and the peak rate."""


@rule
def schedule_builds(ctx: RuleContext) -> list[str]:
    """The schedule the ranks build (:meth:`LRSchedulerArgs.spec`, in ``engine/build.py``), built here from the
    same keys: cycles that fit the steps, a known style. With ``train_epochs`` the steps are counted from the data
    on the ranks, which build it then."""
    train_iters = ctx.get("train_iters")
    peak, _ = peak_lr_setting(ctx.get("lr"), ctx.get("optimizer"))
    if not train_iters or peak is None:
        return []  # no length or no rate: their own rules say so (or the ranks count epochs)
    schedule = cast(LRSchedulerArgs, ctx.args)
    floor = peak * schedule.min_lr_ratio if schedule.min_lr_ratio is not None else schedule.min_lr
    if min_lr_problem(peak, floor) is not None:
        return []  # learning_rates_ordered names it (engine/optimizer_checks.py)
    try:
        schedule.spec(int(train_iters), peak)
    except ConfigError as err:
        given = [ctx.show(key) for key in SCHEDULE_KEYS if ctx.given(key)] or [ctx.show("train_iters")]
        return [f"the learning-rate schedule of {', '.join(given)}: {err.message}"]
    return []


# --- the schedule a checkpoint recorded, against the config's (before a resume) ---------------------------
def _peak_lr(recorded: dict[str, Any]) -> float | None:
    if recorded.get("lr") is not None:
        return float(recorded["lr"])
    block = recorded.get("optimizer") or {}
    params = block.get("params") if isinstance(block, dict) else None
    return float(params["lr"]) if isinstance(params, dict) and params.get("lr") is not None else None


def schedule_problems(ctx: RuleContext, start: Start) -> list[str]:
    """Before launch, the LR schedule the checkpoint to be resumed recorded against this config's
    (``checkpointing/resume_checks.py`` finds ``start``; the argument layer hands it this check): a resume that
    restores the schedule's state under another schedule is refused by the ranks
    (``LRScheduler.load_state_dict``) unless the config says whose schedule wins."""
    if start.weights_only or ctx.get("no_load_optim") or ctx.get("override_lr_scheduler") \
            or ctx.get("use_checkpoint_lr_scheduler"):
        return []
    recorded = start.args
    saved_iters, saved_peak = recorded.get("train_iters"), _peak_lr(recorded)
    train_iters = ctx.get("train_iters")
    schedule = cast(LRSchedulerArgs, ctx.args)
    peak = _peak_lr({"lr": ctx.get("lr"), "optimizer": _as_dict(ctx.get("optimizer"))})
    if not isinstance(saved_iters, int) or saved_peak is None or not train_iters or peak is None:
        return []  # an epoch-based length is known on the ranks only; they compare there
    style = str(recorded.get("lr_decay_style") or schedule.lr_decay_style)
    entry = plugins.find("lr_decay_style", style)
    keys = set(LRSchedulerArgs.model_fields) | set(entry.keys.model_fields if entry is not None and entry.keys else ())
    saved_values = {key: recorded[key] for key in keys if key in recorded
                    and key in getattr(type(ctx.args), "model_fields", {})}  # the honesty test's recorder has none
    try:
        saved_spec = cast(LRSchedulerArgs, ctx.args.model_copy(update=saved_values)).spec(saved_iters, saved_peak)
        spec = schedule.spec(int(train_iters), peak)
    except Exception:  # noqa: BLE001 - a schedule the ranks cannot build either is reported by its own rule
        return []
    differences = spec_differences(saved_spec, spec)
    if not differences:
        return []
    changed = [key for key in sorted(saved_values) if saved_values[key] != ctx.get(key)]
    if saved_iters != train_iters:
        changed.append("train_iters")
    if saved_peak != peak:
        changed.append("lr" if ctx.get("lr") is not None else "optimizer")
    shown = ", ".join(ctx.show(key) for key in changed) or "the config"
    return [f"{shown}: {start.ckpt} was trained with another LR schedule ({'; '.join(differences)}); resuming "
            "it restores that schedule's state. Set override_lr_scheduler: true to follow this config's schedule "
            "from here on, or use_checkpoint_lr_scheduler: true to keep the checkpoint's"]


def _as_dict(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value
