"""LR schedules are pure functions of the step: check their shape at known points."""

from __future__ import annotations

import inspect

import math

import pytest
import torch

from megatron.errors import ConfigError
from megatron import plugins
from megatron.training.lr_schedules import (
    LRScheduler,
    ScheduleSpec,
    cycle_starts_for,
    lr_at,
)
from megatron.neox_arguments import config_from_mapping
from megatron.training.lr_config import LRSchedulerArgs


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_registry_has_neox_and_levanter_styles() -> None:
    assert {"constant", "linear", "cosine", "exponential", "inv_sqrt", "inv", "wsd"} <= set(plugins.names("lr_decay_style"))


def test_warmup_is_linear_from_zero_and_reaches_max() -> None:
    """GPT-NeoX's AnnealingLR: lr = max_lr * step / warmup, so the first update uses 0."""
    spec = ScheduleSpec("constant", max_lr=2.0, total_steps=100, warmup_steps=4)
    assert [lr_at(spec, s) for s in range(6)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]


def test_warmup_then_linear_decay_matches_gpt_neox_formula() -> None:
    """GPT-NeoX: step <= W -> max*step/W; after: max*(T-step)/(T-W) floored at min_lr."""
    spec = ScheduleSpec("linear", max_lr=1.0, total_steps=20, warmup_steps=5, min_lr=0.05)

    def neox(step: int) -> float:
        if step <= 5:
            return step / 5
        return max((20 - step) / (20 - 5), 0.05)

    assert [lr_at(spec, s) for s in range(25)] == [approx(neox(min(s, 20))) for s in range(25)]


def test_linear_decays_to_floor_at_the_end() -> None:
    spec = ScheduleSpec("linear", max_lr=1.0, total_steps=110, warmup_steps=10, min_lr=0.0)
    assert lr_at(spec, 10) == approx(1.0)
    assert lr_at(spec, 60) == approx(0.5)
    assert lr_at(spec, 109) == approx(0.01)
    assert lr_at(spec, 500) == approx(0.0)  # fully decayed (to min_lr) after the schedule ends


def test_cosine_midpoint_and_min_lr_floor() -> None:
    spec = ScheduleSpec("cosine", max_lr=1.0, total_steps=100, min_lr=0.2)
    assert lr_at(spec, 0) == approx(1.0)
    assert lr_at(spec, 50) == approx(0.5)
    # neox semantics: the cosine goes towards 0, floored at min_lr
    assert lr_at(spec, 80) == approx(max(0.5 * (1 + math.cos(math.pi * 0.8)), 0.2))
    assert lr_at(spec, 99) == approx(0.2)


def test_exponential_halves_over_the_decay() -> None:
    spec = ScheduleSpec("exponential", max_lr=1.0, total_steps=100)
    assert lr_at(spec, 0) == approx(1.0)
    assert lr_at(spec, 50) == approx(2 ** -0.5)


def test_inv_sqrt_and_inv_use_timescale() -> None:
    sq = ScheduleSpec("inv_sqrt", max_lr=1.0, total_steps=1000, warmup_steps=10, timescale=10)
    assert lr_at(sq, 10) == approx(1.0)
    assert lr_at(sq, 40) == approx(0.5)  # 1/sqrt(1 + 30/10)
    inv = ScheduleSpec("inv", max_lr=1.0, total_steps=1000, timescale=10)
    assert lr_at(inv, 30) == approx(0.25)


def test_wsd_is_stable_then_decays_in_last_fraction() -> None:
    spec = ScheduleSpec("wsd", max_lr=1.0, total_steps=100, warmup_steps=10, decay_fraction=0.2)
    assert lr_at(spec, 50) == approx(1.0)
    assert lr_at(spec, 79) == approx(1.0)
    assert lr_at(spec, 90) == approx(0.5)
    default = ScheduleSpec("wsd", max_lr=1.0, total_steps=100)
    assert lr_at(default, 79) == approx(1.0) and lr_at(default, 90) == approx(0.5)


def test_decay_fraction_applies_to_cosine_too() -> None:
    spec = ScheduleSpec("cosine", max_lr=1.0, total_steps=100, decay_fraction=0.5)
    assert lr_at(spec, 49) == approx(1.0)
    assert lr_at(spec, 75) == approx(0.5)


def test_cycles_rewarm_from_min_lr() -> None:
    spec = ScheduleSpec(
        "linear", max_lr=1.0, min_lr=0.1, total_steps=100, warmup_steps=10, rewarmup_steps=5,
        cycle_starts=(0, 50),
    )
    assert lr_at(spec, 49) == approx(max(1.0 - 39 / 40, 0.1))
    assert lr_at(spec, 50) == approx(0.1)
    assert lr_at(spec, 54) == approx(0.1 + 0.9 * 4 / 5)
    assert lr_at(spec, 55) == approx(1.0)
    assert lr_at(spec, 99) == approx(0.1)


def test_cycle_starts() -> None:
    assert cycle_starts_for(100, None, None) == (0,)
    assert cycle_starts_for(100, 4, None) == (0, 25, 50, 75)
    assert cycle_starts_for(100, [30, 60], None) == (0, 30, 60)
    assert cycle_starts_for(100, None, 40) == (0, 40, 80)
    assert cycle_starts_for(100, None, [10, 20, 30]) == (0, 10, 30)
    with pytest.raises(ConfigError):
        cycle_starts_for(100, [0, 150], None)
    with pytest.raises(ConfigError):
        cycle_starts_for(100, 2, 10)


def test_bad_specs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="lr_decay_style"):
        ScheduleSpec("triangle", max_lr=1.0, total_steps=10)
    with pytest.raises(ConfigError, match="min_lr"):
        ScheduleSpec("linear", max_lr=1.0, min_lr=2.0, total_steps=10)


def test_min_lr_above_lr_is_one_check() -> None:
    """``min_lr <= lr`` is decided by one function: the rule before launch and a spec built in Python
    both say what it says (issue 20: no invariant checked twice)."""
    from megatron.training.optimizer_checks import learning_rates_ordered
    from megatron.training.lr_schedules import min_lr_problem

    assert min_lr_problem(1.0, 1.0) is None and min_lr_problem(1.0, 0.0) is None
    with pytest.raises(ConfigError) as err:
        ScheduleSpec("linear", max_lr=1.0, min_lr=2.0, total_steps=10)
    assert err.value.message == min_lr_problem(1.0, 2.0) == (
        "lr=1.0 is below min_lr=2.0: the schedule decays from lr down to min_lr")
    rule_source = inspect.getsource(learning_rates_ordered)
    assert "min_lr_problem(" in rule_source and "< min_lr" not in rule_source


def _lr(**kw: object) -> LRSchedulerArgs:
    """The schedule keys through the real loader."""
    values = dict(lr_decay_style="cosine", warmup=0.01)
    values.update(kw)
    return config_from_mapping(values).args


def test_spec_from_neox_args() -> None:
    spec = _lr().spec(1000, 1e-3)
    assert spec.total_steps == 1000 and spec.warmup_steps == 10 and spec.max_lr == 1e-3
    assert _lr(lr_decay_iters=500).spec(1000, 1e-3).total_steps == 500
    assert _lr(lr_decay_fraction=0.25).spec(1000, 1e-3).total_steps == 250
    assert _lr(warmup=30).spec(1000, 1e-3).warmup_steps == 30  # >= 1 means steps
    assert _lr(min_lr_ratio=0.1).spec(1000, 1e-3).min_lr == pytest.approx(1e-4)
    cyc = _lr(cycles=2, rewarmup=0.1).spec(1000, 1e-3)
    assert cyc.cycle_starts == (0, 500) and cyc.rewarmup_steps == 50
    with pytest.raises(ConfigError):
        _lr().spec(0, 1e-3)


def _resumed(saved: ScheduleSpec, current: ScheduleSpec, policy: str) -> LRScheduler:
    p = torch.nn.Parameter(torch.zeros(2))
    before = LRScheduler(torch.optim.SGD([p], lr=1.0), saved)
    for _ in range(3):
        before.step()
    after = LRScheduler(torch.optim.SGD([p], lr=1.0), current, policy=policy)  # type: ignore[arg-type]
    after.load_state_dict(before.state_dict())
    return after


def test_resuming_with_another_schedule_follows_the_override_keys() -> None:
    """Megatron/GPT-NeoX semantics of override_lr_scheduler / use_checkpoint_lr_scheduler."""
    saved = ScheduleSpec("linear", max_lr=1.0, total_steps=10)
    changed = ScheduleSpec("linear", max_lr=0.5, total_steps=20)
    with pytest.raises(ConfigError, match="max_lr: checkpoint 1.0, config 0.5.*override_lr_scheduler"):
        _resumed(saved, changed, "strict")
    assert _resumed(saved, changed, "config").get_last_lr() == [approx(lr_at(changed, 3))]
    kept = _resumed(saved, changed, "checkpoint")
    assert kept.spec == saved and kept.get_last_lr() == [approx(lr_at(saved, 3))]
    assert _resumed(saved, saved, "strict").num_steps == 3  # same schedule: nothing to decide
    # the keys choose the policy
    assert _lr().resume_policy == "strict"
    assert _lr(override_lr_scheduler=True).resume_policy == "config"
    assert _lr(use_checkpoint_lr_scheduler=True).resume_policy == "checkpoint"


def test_scheduler_sets_param_groups_and_resumes() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [], "lr_scale": 0.5}], lr=123.0)
    spec = ScheduleSpec("linear", max_lr=1.0, total_steps=10)
    sched = LRScheduler(opt, spec)
    assert opt.param_groups[0]["lr"] == approx(1.0)
    assert opt.param_groups[1]["lr"] == approx(0.5)
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == approx(0.5)
    again = LRScheduler(opt, spec)
    again.load_state_dict(sched.state_dict())
    assert again.num_steps == 5 and opt.param_groups[0]["lr"] == approx(0.5)


def test_warmup_of_one_is_the_whole_span_as_in_gpt_neox() -> None:
    from megatron.training.lr_schedules import steps_of

    assert steps_of(1, 200) == 200  # a fraction, like the config rules read it
    assert steps_of(1.0, 200) == 200
    assert steps_of(0.05, 200) == 10
    assert steps_of(20, 200) == 20  # whole numbers above 1 are steps


def test_fractional_warmup_follows_gpt_neox_float_warmup() -> None:
    """GPT-NeoX's warmup is ``warmup * lr_decay_iters`` steps as a float: with 0.1 x 3 = 0.3 steps the
    first update still uses lr 0, and the cosine decays over the 2.7 steps after it."""
    import math

    from megatron.training.lr_schedules import lr_at

    spec = _lr(warmup=0.1, lr_decay_style="cosine").spec(3, 1.0)
    assert spec.warmup_steps == pytest.approx(0.3)
    warmup, end = 0.3, 3.0
    for step in range(4):
        if step <= warmup:
            want = step / warmup
        else:
            ratio = min((step - warmup) / (end - warmup), 1.0)
            want = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        assert lr_at(spec, step) == pytest.approx(want, abs=1e-12), step
