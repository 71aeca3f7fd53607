"""Levanter's and fms-fsdp's learning-rate curves, as ``lr_decay_style`` plug-ins that own the whole curve.

GPT-NeoX's styles (``megatron/engine/lr_schedules.py``) share one phase structure (warmup, stable,
decay floored at ``min_lr``). The two dialects' schedules are built differently, so each is one
registry entry computing its project's curve itself, per step, from its own keys:

* ``levanter``: Levanter's ``OptimizerConfig.lr_scheduler`` (``src/levanter/optim/config.py`` at
  stanford-crfm/levanter 9263f81e): per cycle a linear warmup from the previous cycle's last value
  (``optax.linear_schedule``), a stable phase, then the decay: ``cosine`` =
  ``optax.cosine_decay_schedule(lr, decay_steps, alpha=min_lr_ratio, exponent)`` (interpolated to
  ``min_lr_ratio x lr``, not floored), ``linear`` = lr to ``min_lr`` over the decay steps, ``inv_sqrt`` =
  ``max(lr x min(1, 1/sqrt(max(t + warmup, 1)/timescale)), min_lr)`` (it holds lr until ``t + warmup``
  reaches the timescale, 10000), ``inv`` = ``max(lr x min(1, 1/((lr/min_lr - 1) x max(t, 1)/decay + 1)),
  min_lr)`` (ends at ``min_lr``), ``constant``; fractions of a cycle are truncated to whole steps
  (``_convert_frac_or_steps``), cycle boundaries are ``int(total / cycles x (i + 1))``, and the
  deprecated ``cooldown`` adds a final linear decay to ``min_lr``.
* ``fms`` and ``fms_annealing``: ``main_training_llama.py`` of foundation-model-stack/fms-fsdp 5a296afe:
  ``lr x min(1 - (1 - min(t, W)/W)^2, 0.1 + 0.45 (1 + cos(pi min(t, N)/N)))`` with
  ``W = min(2000, N // 20)``, and ``lr x (1 - t/N)`` for ``training_stage: annealing``. fms-fsdp divides
  by ``W`` and so fails for N < 20; here W = 0 means no warmup.

``t`` is the optimizer step (0 = the first update, as optax's count and torch's ``LambdaLR`` have it),
``N`` is ``train_iters``. GPT-NeoX's schedule keys (``warmup``, ``min_lr``, ``cycles``, ...) are not
read by these styles and are refused beside them (:func:`whole_curve_styles_read_their_own_keys`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field

from megatron import plugins
from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError
from megatron.engine.lr_schedules import ScheduleSpec

LevanterSchedule = Literal["constant", "cosine", "linear", "inv_sqrt", "inv"]

NEOX_SCHEDULE_KEYS = ("warmup", "min_lr", "min_lr_ratio", "lr_decay_iters", "lr_decay_fraction", "cycles",
                      "cycle_length", "rewarmup", "decay_fraction")
"""GPT-NeoX's (and Deepy's) schedule keys, which a whole-curve style does not read."""


class LevanterScheduleArgs(ArgGroup):
    """Levanter's schedule keys (``optimizer.*`` of its ``OptimizerConfig``), read by ``lr_decay_style: levanter``."""

    levanter_lr_schedule: LevanterSchedule = "cosine"
    """Levanter's ``optimizer.lr_schedule``: the decay after warmup (and stable phase) of each cycle."""

    levanter_warmup: float = Field(0.01, ge=0)
    """Levanter's ``optimizer.warmup``: a fraction (<= 1) of the first cycle's steps, truncated, or whole steps."""

    levanter_decay: float | None = Field(None, ge=0)
    """Levanter's ``optimizer.decay``: decay steps per cycle (fraction or steps); None: all after warmup."""

    levanter_rewarmup: float = Field(0.0, ge=0)
    """Levanter's ``optimizer.rewarmup``: warmup of each later cycle, from the previous cycle's last rate."""

    levanter_cooldown: float | None = Field(None, ge=0)
    """Levanter's deprecated ``optimizer.cooldown``: a final linear decay to min_lr (fraction or steps)."""

    levanter_cycles: int | list[int] | None = None
    """Levanter's ``optimizer.cycles``: number of equal cycles, or the steps where cycles end."""

    levanter_cycle_length: float | list[int] | None = None
    """Levanter's ``optimizer.cycle_length``: length of each cycle (fraction or steps), or a list of lengths."""

    levanter_min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Levanter's ``optimizer.min_lr_ratio``: the rate the decay ends at, as a fraction of lr."""

    levanter_cosine_exponent: float = Field(1.0, gt=0)
    """Levanter's ``lr_schedule: {type: cosine, exponent}``: the cosine term is raised to this power."""

    levanter_inv_sqrt_timescale: float = Field(10000.0, gt=0)
    """Levanter's ``lr_schedule: {type: inv_sqrt, timescale}``: steps before the rate starts to fall."""


# ------------------------------------------------------------------------ optax's pieces, in Python

Piece = Callable[[float], float]


def _linear(init: float, end: float, steps: int) -> Piece:
    """``optax.linear_schedule``: constant ``init`` when ``steps <= 0``."""
    if steps <= 0:
        return lambda count: init
    return lambda count: (init - end) * (1 - min(max(count, 0), steps) / steps) + end


def _cosine(init: float, steps: int, alpha: float, exponent: float) -> Piece:
    """``optax.cosine_decay_schedule`` (optax raises for ``steps <= 0``; the check refuses it first)."""
    def piece(count: float) -> float:
        count = min(count, steps)
        return init * ((1 - alpha) * (0.5 * (1 + math.cos(math.pi * count / steps))) ** exponent + alpha)
    return piece


def _inv_sqrt(lr: float, min_lr: float, warmup_steps: int, timescale: float) -> Piece:
    return lambda count: max(lr * min(1.0, 1.0 / math.sqrt(max(count + warmup_steps, 1) / timescale)), min_lr)


def _inv(lr: float, min_lr: float, decay_steps: int) -> Piece:
    def piece(count: float) -> float:
        if min_lr == 0 or decay_steps == 0:  # optax divides by zero: the rate falls to min_lr at once
            return min_lr
        return max(lr * min(1.0, 1.0 / ((lr / min_lr - 1) * max(count, 1) / decay_steps + 1)), min_lr)
    return piece


def frac_or_steps(value: float, total: int) -> int:
    """Levanter's ``_convert_frac_or_steps``: a fraction (<= 1) of ``total``, truncated, or whole steps."""
    if value < 0 or (value > 1 and value % 1 != 0):
        raise ConfigError(f"{value} is neither a fraction in [0, 1] nor a whole number of steps (Levanter)")
    return int(value * total) if value <= 1 else int(value)


def cycle_ends(keys: LevanterScheduleArgs, total: int) -> list[int]:
    """Levanter's ``_get_cycle_minima``: 0, the end of each cycle, ``total``."""
    points: list[int]
    if keys.levanter_cycle_length is not None:
        if keys.levanter_cycles is not None:
            raise ConfigError("Levanter uses either cycle_length or cycles, not both")
        if isinstance(keys.levanter_cycle_length, list):
            ends = [sum(keys.levanter_cycle_length[: i + 1]) for i in range(len(keys.levanter_cycle_length))]
            if ends and ends[-1] > total:
                raise ConfigError(f"the cycle lengths add up to {ends[-1]} > {total} steps")
            points = ends
        else:
            length = frac_or_steps(keys.levanter_cycle_length, total)
            if length < 1:
                raise ConfigError(f"cycle_length {keys.levanter_cycle_length} is less than one step of {total}")
            points = [i * length for i in range(1, total // length)]
    elif isinstance(keys.levanter_cycles, int):
        points = [int(total / keys.levanter_cycles * (i + 1)) for i in range(keys.levanter_cycles - 1)]
    elif isinstance(keys.levanter_cycles, list):
        points = list(keys.levanter_cycles)
    else:
        points = []
    points.insert(0, 0)
    if points[-1] != total:
        points.append(total)
    return points


def levanter_curve(keys: LevanterScheduleArgs, num_train_steps: int, lr: float = 1.0) -> Callable[[int], float]:
    """Levanter's learning rate at each optimizer step, as ``OptimizerConfig.lr_scheduler`` builds it
    (``optax.join_schedules`` of the pieces: piece ``i + 1`` sees the step minus boundary ``i``)."""
    cooldown = frac_or_steps(keys.levanter_cooldown, num_train_steps) if keys.levanter_cooldown is not None else 0
    main = num_train_steps - cooldown
    points = cycle_ends(keys, main)
    min_lr = lr * keys.levanter_min_lr_ratio
    pieces: list[Piece] = []
    boundaries: list[int] = []
    previous_end = 0.0
    decay: Piece = lambda count: lr  # noqa: E731
    decay_steps = 0
    for cycle, (start, end) in enumerate(zip(points[:-1], points[1:])):
        steps = end - start
        warmup = frac_or_steps(keys.levanter_warmup if cycle == 0 else keys.levanter_rewarmup, steps)
        if warmup != 0:
            pieces.append(_linear(previous_end, lr, warmup))
            boundaries.append(start + warmup)
        decay_steps = frac_or_steps(keys.levanter_decay, steps) if keys.levanter_decay is not None else steps - warmup
        stable = steps - warmup - decay_steps
        if stable != 0:
            pieces.append(lambda count: lr)
            boundaries.append(start + warmup + stable)
        decay = _decay_piece(keys, lr, min_lr, warmup, decay_steps)
        previous_end = decay(decay_steps)
        pieces.append(decay)
        boundaries.append(end)
    if cooldown != 0:
        pieces.append(_linear(decay(decay_steps), min_lr, cooldown))

    def at(step: int) -> float:
        value = pieces[0](step)
        for boundary, piece in zip(boundaries, pieces[1:]):
            if step >= boundary:
                value = piece(step - boundary)
        return value

    return at


def _decay_piece(keys: LevanterScheduleArgs, lr: float, min_lr: float, warmup: int, decay_steps: int) -> Piece:
    kind = keys.levanter_lr_schedule
    if kind == "constant":
        return lambda count: lr
    if kind == "cosine":
        if decay_steps <= 0:
            raise ConfigError(f"Levanter's cosine schedule needs decay steps > 0, got {decay_steps} (optax refuses it)")
        return _cosine(lr, decay_steps, keys.levanter_min_lr_ratio, keys.levanter_cosine_exponent)
    if kind == "linear":
        return _linear(lr, min_lr, decay_steps)
    if kind == "inv_sqrt":
        return _inv_sqrt(lr, min_lr, warmup, keys.levanter_inv_sqrt_timescale)
    return _inv(lr, min_lr, decay_steps)


@lru_cache(maxsize=8)
def _cached_levanter(options: tuple[tuple[str, Any], ...], total: int) -> Callable[[int], float]:
    values = {key: (list(value) if isinstance(value, tuple) else value) for key, value in options}
    return levanter_curve(LevanterScheduleArgs.model_validate(values), total)


def _hashable(options: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    return tuple((key, tuple(value) if isinstance(value, list) else value) for key, value in options)


def _levanter_shape(progress: float, steps: float, spec: ScheduleSpec) -> float:
    # a whole-curve style: ``steps`` is the optimizer step, a whole number (lr_config.spec gives it no
    # warmup of its own)
    return _cached_levanter(_hashable(spec.options), spec.total_steps)(int(steps))


# ------------------------------------------------------------------------------------- fms-fsdp


def fms_warmup_steps(num_steps: int) -> int:
    """fms-fsdp's ``warmup_interval = min(2000, num_steps // 20)``."""
    return min(2000, num_steps // 20)


def fms_multiplier(step: int, num_steps: int) -> float:
    """fms-fsdp's ``schedule(x)`` of ``training_stage: initial`` (its ``LambdaLR`` multiplies lr by it)."""
    warmup = fms_warmup_steps(num_steps)
    rise = 1.0 if warmup == 0 else 1 - (1 - min(step, warmup) / warmup) ** 2
    return min(rise, 0.1 + 0.5 * (1 - 0.1) * (1 + math.cos(min(step, num_steps) / num_steps * math.pi)))


def _fms_shape(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return fms_multiplier(int(steps), spec.total_steps)  # a whole-curve style: the optimizer step


def _fms_annealing_shape(progress: float, steps: float, spec: ScheduleSpec) -> float:
    return 1 - steps / spec.total_steps


@rule
def levanter_schedule_is_one_levanter_builds(ctx: RuleContext) -> list[str]:
    """Levanter's own refusals, before launch (its optax cosine with no decay steps, bad cycles)."""
    if str(ctx.get("lr_decay_style")) != "levanter" or not ctx.get("train_iters"):
        return []
    keys = LevanterScheduleArgs(**{key: ctx.get(key) for key in LevanterScheduleArgs.model_fields})
    try:
        levanter_curve(keys, int(ctx.get("train_iters")))
    except ConfigError as err:
        return [f"{ctx.show('lr_decay_style')}: {err}"]
    return []


# a style's need ``whole_curve``: it computes the whole curve; ``LRSchedulerArgs.spec`` adds no phases of its own
plugins.register("lr_decay_style", "levanter", keys=LevanterScheduleArgs, whole_curve=True)(_levanter_shape)
plugins.register("lr_decay_style", "fms", whole_curve=True)(_fms_shape)
plugins.register("lr_decay_style", "fms_annealing", whole_curve=True)(_fms_annealing_shape)
plugins.builtins_declared("lr_decay_style")  # the last of Deepy's schedules (GPT-NeoX's: lr_schedules.py)


@rule
def whole_curve_styles_read_their_own_keys(ctx: RuleContext) -> list[str]:
    """GPT-NeoX's schedule keys beside a style that computes its whole curve would be ignored: refuse them."""
    style = plugins.find("lr_decay_style", str(ctx.get("lr_decay_style")))
    if style is None or not style.needs.get("whole_curve"):
        return []
    given = [key for key in NEOX_SCHEDULE_KEYS if ctx.given(key)]
    if not given:
        return []
    own = "its levanter_* keys" if style.name == "levanter" else "train_iters and lr only"
    return [f"{', '.join(ctx.show(key) for key in given)} {'is' if len(given) == 1 else 'are'} not read by "
            f"{ctx.show('lr_decay_style')}, which computes its whole curve from {own}: remove "
            f"{'it' if len(given) == 1 else 'them'}"]
