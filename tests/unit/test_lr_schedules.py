"""LR schedules are pure functions of the step: check their shape at known points."""

from __future__ import annotations

import inspect

import math

import pytest
import torch

from megatron.errors import ConfigError
from megatron import plugins
from megatron.engine.lr_schedules import (
    LRScheduler,
    ScheduleSpec,
    cycle_starts_for,
    lr_at,
)
from megatron.neox_arguments import config_from_mapping
from megatron.engine.lr_config import LRSchedulerArgs


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_registry_has_neox_and_levanter_styles() -> None:
    assert {"constant", "linear", "cosine", "exponential", "inv_sqrt", "inv", "wsd"} <= set(plugins.names("lr_decay_style"))


# GPT-NeoX's AnnealingLR.get_lr, megatron/learning_rates.py:63-89 at ea7aefd8 (warmup max(1, n) since
# #1379), with T and W from megatron/training.py:1117-1126: written out here from the formulas, not
# taken from Deepy's code.
def neox_lr(style: str, lr: float, min_lr: float, warmup: float, T: int, n: int) -> float:
    W = warmup * T
    if W > 0 and n <= W:
        return lr * max(1, n) / W
    m, S = n - W, T - W
    value = {
        "linear": lr * (S - m) / S,
        "cosine": min_lr + (lr - min_lr) / 2.0 * (math.cos(math.pi * m / S) + 1),
        "exponential": lr * math.exp(-0.693 * m / S),
        "constant": lr,
    }[style]
    return max(value, min_lr)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential"])
def test_every_neox_style_equals_gpt_neox_formula(style: str) -> None:
    """Per-step values through the config keys, to 1e-7 relative: min_lr 0 and > 0, warmup 0, a
    fraction of a step (the first update then uses lr / W > lr, as in GPT-NeoX since #1379) and many
    steps, and steps past lr_decay_iters (GPT-NeoX's cosine rises again there)."""
    for lr, min_lr, warmup, iters, decay in [(6e-4, 0.0, 0.01, 1000, None), (6e-4, 6e-5, 0.01, 1000, None),
                                             (1.0, 0.3, 0.1, 97, None), (1.0, 0.1, 0.1, 3, None),
                                             (3e-4, 3e-5, 0.0, 200, None), (3e-4, 3e-5, 0.25, 300, 120)]:
        keys: dict[str, object] = dict(lr_decay_style=style, min_lr=min_lr, warmup=warmup)
        if decay is not None:
            keys["lr_decay_iters"] = decay
        spec = _lr(**keys).spec(iters, lr)
        T = decay or iters
        for n in range(iters + 5):
            want = neox_lr(style, lr, min_lr, warmup, T, n)
            assert lr_at(spec, n) == pytest.approx(want, rel=1e-7, abs=0), (keys, iters, n)


def test_neox_warmup_first_update_is_not_zero() -> None:
    """#1379: step 0 uses lr / W (it used 0 before); the peak is reached at step W."""
    spec = ScheduleSpec("constant", max_lr=2.0, total_steps=100, warmup_steps=4)
    assert [lr_at(spec, s) for s in range(6)] == [0.5, 0.5, 1.0, 1.5, 2.0, 2.0]


def test_cosine_is_interpolated_to_min_lr_and_linear_is_floored() -> None:
    cos = ScheduleSpec("cosine", max_lr=1.0, total_steps=100, min_lr=0.2)
    assert lr_at(cos, 50) == approx(0.6)  # halfway between 1.0 and 0.2, not max(0.5, 0.2)
    assert lr_at(cos, 100) == approx(0.2)
    lin = ScheduleSpec("linear", max_lr=1.0, total_steps=100, min_lr=0.2)
    assert lr_at(lin, 50) == approx(0.5) and lr_at(lin, 90) == approx(0.2)  # cut at the floor


def test_exponential_uses_gpt_neoxs_0_693() -> None:
    spec = ScheduleSpec("exponential", max_lr=1.0, total_steps=100)
    assert lr_at(spec, 50) == approx(math.exp(-0.693 / 2))
    assert lr_at(spec, 50) != approx(2 ** -0.5)


def test_decay_steps_follow_gpt_neox_precedence() -> None:
    """lr_decay_iters wins over lr_decay_fraction, which is floored (training.py:1118-1124)."""
    assert _lr(lr_decay_fraction=0.333).spec(1000, 1e-3).total_steps == 333
    assert _lr(lr_decay_fraction=0.3339).spec(1000, 1e-3).total_steps == 333  # floor, not round
    assert _lr(lr_decay_fraction=0.5, lr_decay_iters=40).spec(1000, 1e-3).total_steps == 40
    assert _lr(lr_decay_iters=0).spec(1000, 1e-3).total_steps == 1  # max(1, .)


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
    floored = ScheduleSpec("cosine", max_lr=1.0, min_lr=0.2, total_steps=100, decay_fraction=0.5)
    assert lr_at(floored, 75) == approx(0.6)  # interpolated to min_lr here too


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
    from megatron.engine.optimizer_checks import learning_rates_ordered
    from megatron.engine.lr_schedules import min_lr_problem

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
    from megatron.engine.lr_schedules import steps_of

    assert steps_of(1, 200) == 200  # a fraction, like the config rules read it
    assert steps_of(1.0, 200) == 200
    assert steps_of(0.05, 200) == 10
    assert steps_of(20, 200) == 20  # whole numbers above 1 are steps


def test_fractional_warmup_follows_gpt_neox_float_warmup() -> None:
    """GPT-NeoX's warmup is ``warmup * lr_decay_iters`` steps as a float: with 0.1 x 3 = 0.3 steps the
    first update uses lr / 0.3 (``max(1, 0) / 0.3``), then the cosine decays over the 2.7 steps after."""
    spec = _lr(warmup=0.1, lr_decay_style="cosine").spec(3, 1.0)
    assert spec.warmup_steps == pytest.approx(0.3)
    assert lr_at(spec, 0) == pytest.approx(1 / 0.3)
    for step in (1, 2):
        assert lr_at(spec, step) == pytest.approx(0.5 * (math.cos(math.pi * (step - 0.3) / 2.7) + 1.0))


def test_gpt_neox_curve_surprises_are_said_before_launch() -> None:
    from megatron.config_rules import RuleContext
    from megatron.engine.lr_config import neox_curve_surprises

    ctx = RuleContext(args=config_from_mapping(dict(lr_decay_style="cosine", warmup=0.1, train_iters=5,
                                                    lr_decay_iters=3)).args)
    assert neox_curve_surprises(ctx) == []
    assert len(ctx.warnings) == 2
    assert "first update 3.33 x lr" in ctx.warnings[0] and "cosine rises again" in ctx.warnings[1]
