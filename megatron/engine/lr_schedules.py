"""Learning-rate schedules: pure functions of the optimizer step.

A schedule is described by a frozen :class:`ScheduleSpec` and evaluated by :func:`lr_at`. Nothing
here holds state except :class:`LRScheduler`, the thin object DeepSpeed drives (it calls ``step()``
after every *successful* optimizer step and saves ``state_dict()`` in checkpoints), which only
remembers how many steps were taken and asks :func:`lr_at` for the value.

Decay shapes come from a registry keyed by the ``lr_decay_style`` config string:

* GPT-NeoX styles ``constant``, ``linear``, ``cosine``, ``exponential``: with one cycle and no
  ``decay_fraction`` (everything a GPT-NeoX config can say), :func:`lr_at` is GPT-NeoX's own curve,
  ``megatron/engine/lr_neox.py`` (warmup ``lr * max(1, step) / W``; linear and exponential floored
  at ``min_lr``, cosine interpolated to it). With Deepy's extras the same shapes run in the phases
  below.
* Levanter styles ``inv_sqrt`` and ``inv`` (``max_lr / sqrt(1 + t/T)`` and ``max_lr / (1 + t/T)``
  with timescale ``T``), and ``wsd`` (warmup-stable-decay: constant, then a linear decay over the
  final ``decay_fraction`` of the steps).

Every style shares the same phases per cycle: a linear warmup, an optional stable phase (when
``decay_fraction`` is set, the decay only occupies that final fraction of the cycle), then the
decay shape. Training may be split into several cycles (``cycles`` or ``cycle_length``); cycles
after the first re-warm from ``min_lr`` over ``rewarmup`` steps.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError
from megatron.engine.lr_neox import EXPONENTIAL_RATE, NEOX_STYLES, annealing_lr

# A decay shape maps progress through the decay phase (0 at its start, 1 at its end) and the
# number of steps already spent decaying to a multiplier of max_lr before the min_lr floor.
DecayShape = Callable[[float, float, "ScheduleSpec"], float]



def register_decay(
    name: str, *, keys: type[ArgGroup] | None = None, check: plugins.Check | None = None
) -> Callable[[DecayShape], DecayShape]:
    """Register a decay shape as the ``lr_decay_style`` plug-in ``name``; its ``keys`` (read by the
    shape from ``spec.options``) join the config."""
    return plugins.register("lr_decay_style", name, keys=keys, check=check)


def decay_shape(style: str) -> DecayShape:
    return plugins.get("lr_decay_style", style).resolve()


@register_decay("constant")
def _constant(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return 1.0


@register_decay("linear")
def _linear(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return 1.0 - progress


@register_decay("cosine")
def _cosine(progress: float, steps: float, spec: ScheduleSpec) -> float:
    # interpolated from max_lr to min_lr, as GPT-NeoX's (and Levanter's) cosine is
    floor = spec.min_lr / spec.max_lr if spec.max_lr else 0.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@register_decay("exponential")
def _exponential(progress: float, steps: float, spec: ScheduleSpec) -> float:
    # halves the learning rate over the whole decay phase, with GPT-NeoX's constant 0.693
    return math.exp(-EXPONENTIAL_RATE * progress)


@register_decay("inv_sqrt")
def _inv_sqrt(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return 1.0 / math.sqrt(1.0 + steps / spec.timescale)


@register_decay("inv")
def _inv(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return 1.0 / (1.0 + steps / spec.timescale)


@register_decay("wsd")
def _wsd(progress: float, steps: float, spec: ScheduleSpec) -> float:
    # the stable phase comes from decay_fraction (see ScheduleSpec.effective_decay_fraction)
    return 1.0 - progress


# wsd without an explicit decay_fraction decays over the last 20% of each cycle (Levanter's
# default cooldown share); the other styles decay over the whole post-warmup part.
WSD_DEFAULT_DECAY_FRACTION = 0.2


def min_lr_problem(lr: float, min_lr: float, shown_lr: str | None = None,
                   shown_min_lr: str | None = None) -> str | None:
    """The one check of ``min_lr <= lr`` (the schedule decays from the peak down to the floor): run
    before launch on the user's keys (``learning_rates_ordered`` in ``engine/optimizer_checks.py``, with
    the keys shown as ``key=value (file:line)``) and by a :class:`ScheduleSpec` built directly in Python."""
    if lr >= min_lr:
        return None
    return (f"{shown_lr or f'lr={lr}'} is below {shown_min_lr or f'min_lr={min_lr}'}: the schedule decays from lr "
            f"down to min_lr")


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything :func:`lr_at` needs; built from the config by ``LRSchedulerArgs.spec``."""

    style: str
    max_lr: float
    total_steps: int
    """Steps the schedule spans (GPT-NeoX ``lr_decay_iters``, default ``train_iters``)."""
    min_lr: float = 0.0
    warmup_steps: float = 0
    """Warmup of the first cycle, in steps; fractional as GPT-NeoX's ``warmup * lr_decay_iters`` is
    (0.3 steps still gives the first update lr 0, as there)."""
    rewarmup_steps: float = 0
    """Warmup of every later cycle, from ``min_lr`` back up to ``max_lr``."""
    cycle_starts: tuple[int, ...] = (0,)
    """First step of each cycle; the last cycle runs to ``total_steps``."""
    decay_fraction: float | None = None
    """Share of each cycle spent decaying; before it the rate stays at ``max_lr``."""
    timescale: float = 10_000.0
    """``T`` of the ``inv``/``inv_sqrt`` shapes, in steps."""
    options: tuple[tuple[str, Any], ...] = ()
    """The values of the style plug-in's own keys, ``(key, value)`` pairs (``option(key)``)."""

    def __post_init__(self) -> None:
        if plugins.find("lr_decay_style", self.style) is None:
            raise ConfigError(
                f"lr_decay_style: unknown schedule {self.style!r}; "
                f"choose one of {', '.join(plugins.names('lr_decay_style'))}"
            )
        if self.total_steps < 1:
            raise ConfigError(f"lr_decay_iters/train_iters: the schedule needs >= 1 step, got {self.total_steps}")
        problem = min_lr_problem(self.max_lr, self.min_lr)
        if problem:
            raise ConfigError(problem)
        if self.decay_fraction is not None and not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"decay_fraction={self.decay_fraction} must be within [0, 1]")
        if self.timescale <= 0:
            raise ConfigError(f"timescale={self.timescale} must be positive")

    def option(self, key: str) -> Any:
        """The value of the style plug-in's key ``key``."""
        return dict(self.options)[key]

    @property
    def effective_decay_fraction(self) -> float | None:
        if self.decay_fraction is None and self.style == "wsd":
            return WSD_DEFAULT_DECAY_FRACTION
        return self.decay_fraction


def cycle_bounds(spec: ScheduleSpec, step: int) -> tuple[int, int, int]:
    """(cycle index, first step, length) of the cycle containing ``step``."""
    index = max(0, bisect.bisect_right(spec.cycle_starts, step) - 1)
    start = spec.cycle_starts[index]
    end = spec.cycle_starts[index + 1] if index + 1 < len(spec.cycle_starts) else spec.total_steps
    return index, start, max(end - start, 1)


def is_neox_schedule(spec: ScheduleSpec) -> bool:
    """One of GPT-NeoX's styles with nothing GPT-NeoX cannot say (cycles, decay_fraction)."""
    return spec.style in NEOX_STYLES and len(spec.cycle_starts) == 1 and spec.decay_fraction is None


def lr_at(spec: ScheduleSpec, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based: the rate used by the first update)."""
    step = max(step, 0)
    if is_neox_schedule(spec):
        return annealing_lr(spec.style, spec.max_lr, spec.min_lr, spec.warmup_steps, spec.total_steps, step)
    if step >= spec.total_steps:
        # past the schedule: the fully decayed value
        return _within_cycle(spec, *cycle_bounds(spec, spec.total_steps - 1), spec.total_steps)
    return _within_cycle(spec, *cycle_bounds(spec, step), step)


def _within_cycle(spec: ScheduleSpec, index: int, start: int, length: int, step: int) -> float:
    local = step - start
    warmup = spec.warmup_steps if index == 0 else spec.rewarmup_steps
    warmup = min(warmup, length)
    if local < warmup:
        # the first cycle warms from zero (Levanter's linear warmup: the first update uses lr 0), later
        # ones from the floor they decayed to
        floor = 0.0 if index == 0 else spec.min_lr
        return floor + (spec.max_lr - floor) * local / warmup
    after_warmup = length - warmup
    fraction = spec.effective_decay_fraction
    decay_len = after_warmup if fraction is None else float(round(fraction * length))
    decay_len = min(decay_len, after_warmup)
    decay_start = start + length - decay_len
    if step < decay_start or decay_len == 0:
        return spec.max_lr
    steps_decayed = step - decay_start
    progress = min(steps_decayed / decay_len, 1.0)
    scale = decay_shape(spec.style)(progress, steps_decayed, spec)
    return max(spec.max_lr * scale, spec.min_lr)


def steps_of(value: float | int | None, total: int) -> float:
    """A warmup-like quantity: a fraction of ``total`` when in (0, 1], else a number of steps.

    1 is a fraction (the whole span), as in GPT-NeoX and as the config rules read it. A fraction is
    not rounded: GPT-NeoX's warmup is ``warmup * lr_decay_iters`` steps as a float.
    """
    if value is None or value <= 0:
        return 0.0
    if value <= 1:
        return float(value * total)
    return float(int(value))


def cycle_starts_for(
    total_steps: int, cycles: int | Sequence[int] | None, cycle_length: int | Sequence[int] | None
) -> tuple[int, ...]:
    """First step of each cycle.

    ``cycles``: an int (split training into that many equal cycles) or a list of the steps at which
    new cycles begin. ``cycle_length``: an int (every cycle that long) or a list of lengths.
    """
    if cycles is not None and cycle_length is not None:
        raise ConfigError("set only one of cycles and cycle_length")
    if cycle_length is not None:
        # an int repeats until the end of training; a list gives each cycle's length in turn and
        # its last cycle runs to the end
        if isinstance(cycle_length, int):
            if cycle_length < 1:
                raise ConfigError(f"cycle_length={cycle_length} must be >= 1 step")
            return tuple(range(0, total_steps, cycle_length))
        lengths = [int(n) for n in cycle_length]
        if any(n < 1 for n in lengths):
            raise ConfigError(f"cycle_length={lengths}: every length must be >= 1 step")
        starts = [0]
        for n in lengths[:-1]:
            if starts[-1] + n >= total_steps:
                break
            starts.append(starts[-1] + n)
        return tuple(starts)
    if cycles is None:
        return (0,)
    if isinstance(cycles, int):
        if cycles < 1:
            raise ConfigError(f"cycles={cycles} must be >= 1")
        return tuple(sorted({int(round(k * total_steps / cycles)) for k in range(cycles)}))
    points = sorted(int(c) for c in cycles)
    if any(p <= 0 or p >= total_steps for p in points):
        raise ConfigError(f"cycles={list(cycles)}: every boundary must lie within (0, {total_steps})")
    return tuple([0] + points)


SchedulePolicy = Literal["strict", "config", "checkpoint"]
"""How a resumed schedule treats a checkpoint whose schedule differs from the config's:
``strict`` refuses (Megatron/GPT-NeoX's default), ``config`` uses the config's
(``override_lr_scheduler``), ``checkpoint`` keeps the checkpoint's (``use_checkpoint_lr_scheduler``)."""


@dataclass
class LRScheduler:
    """The stateful wrapper DeepSpeed steps; the value itself always comes from :func:`lr_at`."""

    optimizer: Any
    spec: ScheduleSpec
    num_steps: int = 0
    policy: SchedulePolicy = "strict"
    _last_lr: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._apply()

    def get_lr(self) -> list[float]:
        return [lr_at(self.spec, self.num_steps) * g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, increment: int = 1, **_: Any) -> None:
        """Advance after a successful optimizer step (DeepSpeed skips this on fp16 overflow)."""
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "spec": spec_to_dict(self.spec)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        saved = state.get("spec")
        if saved is not None:
            saved_spec = spec_from_dict(saved)
            differences = spec_differences(saved_spec, self.spec)
            if differences and self.policy == "checkpoint":
                self.spec = saved_spec
            elif differences and self.policy == "strict":
                raise ConfigError(
                    "the checkpoint was trained with another LR schedule ("
                    + ", ".join(differences)
                    + "): set override_lr_scheduler: true to use this config's schedule from here on, "
                    "or use_checkpoint_lr_scheduler: true to keep the checkpoint's"
                )
        self._apply()


def spec_to_dict(spec: ScheduleSpec) -> dict[str, Any]:
    data = dataclasses.asdict(spec)
    data["cycle_starts"] = list(spec.cycle_starts)
    data["options"] = [list(pair) for pair in spec.options]
    return data


def spec_from_dict(data: dict[str, Any]) -> ScheduleSpec:
    values = dict(data)
    values["cycle_starts"] = tuple(values.get("cycle_starts", (0,)))
    values["options"] = tuple((str(k), v) for k, v in values.get("options", ()))
    return ScheduleSpec(**values)


def spec_differences(saved: ScheduleSpec, current: ScheduleSpec) -> list[str]:
    """``name: checkpoint X, config Y`` for each schedule field that differs."""
    out = []
    for f in dataclasses.fields(ScheduleSpec):
        a, b = getattr(saved, f.name), getattr(current, f.name)
        if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-12)):
            out.append(f"{f.name}: checkpoint {a}, config {b}")
    return out
