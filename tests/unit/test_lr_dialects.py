"""Levanter's and fms-fsdp's learning-rate curves (``lr_decay_style: levanter | fms | fms_annealing``) per step.

Expected values are Levanter's own ``OptimizerConfig.lr_scheduler`` (src/levanter/optim/config.py at
stanford-crfm/levanter 9263f81e) evaluated with optax 0.2.8 in float32 (written down here, rounded to
7 digits), and fms-fsdp's ``schedule`` lambda (main_training_llama.py at foundation-model-stack/fms-fsdp
5a296afe) re-derived in this file: the points that tell the shapes apart.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.loading import config_from_mapping
from megatron.engine.lr_schedules import lr_at


def curve(style: str, steps: int, lr: float = 1.0, first: int | None = None, **keys: Any) -> list[float]:
    """The rate at steps 0 .. ``first`` (default: every step) of a ``steps``-step run."""
    args = config_from_mapping({"lr_decay_style": style, **keys}).args
    spec = args.spec(steps, lr)
    return [lr_at(spec, s) for s in range(first or steps)]


# (Levanter optimizer keys, num_train_steps, {step: Levanter's lr with learning_rate 1.0})
LEVANTER_POINTS: dict[str, tuple[dict[str, Any], int, dict[int, float]]] = {
    # defaults: cosine, warmup int(0.01 x 100) = 1 step, decayed to min_lr_ratio 0.1 (interpolated)
    "cosine_default": ({}, 100, {0: 0.0, 1: 1.0, 2: 0.9997734, 50: 0.5571396, 75: 0.2343363, 99: 0.1002266}),
    "cosine_exponent": ({"levanter_warmup": 10, "levanter_min_lr_ratio": 0.0, "levanter_cosine_exponent": 2.0}, 50,
                        {0: 0.0, 5: 0.5, 10: 1.0, 30: 0.25, 49: 2.4e-06}),
    # warmup 5 steps, stable, then linear over int(0.4 x 50) = 20 steps to 0.1
    "linear_decay": ({"levanter_lr_schedule": "linear", "levanter_warmup": 0.1, "levanter_decay": 0.4}, 50,
                     {0: 0.0, 4: 0.8, 5: 1.0, 29: 1.0, 30: 1.0, 40: 0.55, 49: 0.145}),
    # holds lr while t + warmup < timescale, then lr / sqrt((t + warmup) / timescale)
    "inv_sqrt": ({"levanter_lr_schedule": "inv_sqrt", "levanter_inv_sqrt_timescale": 20.0, "levanter_warmup": 5}, 100,
                 {0: 0.0, 5: 1.0, 14: 1.0, 15: 1.0, 16: 1.0, 50: 0.6324555, 99: 0.4494666}),
    # inv: max(t, 1) - the first decay step already decays - and it ends at min_lr
    "inv": ({"levanter_lr_schedule": "inv", "levanter_warmup": 0.05}, 100,
            {0: 0.0, 4: 0.8, 5: 0.9134616, 6: 0.9134616, 50: 0.19, 99: 0.1009564}),
    # a second cycle re-warms from where the first ended (min_lr) over int(0.2 x 20) = 4 steps
    "cycles": ({"levanter_cycles": 2, "levanter_rewarmup": 0.2, "levanter_warmup": 0.1}, 40,
               {0: 0.0, 1: 0.5, 2: 1.0, 19: 0.1068365, 20: 0.1, 21: 0.325, 22: 0.55, 23: 0.775, 39: 0.1086466}),
    # cycles of 20 steps: warmup 2 steps, then each later cycle re-warms over int(0.1 x 20) = 2 steps
    "cycle_length": ({"levanter_cycle_length": 20, "levanter_rewarmup": 0.1, "levanter_warmup": 2}, 40,
                     {0: 0.0, 1: 0.5, 2: 1.0, 10: 0.6281416, 19: 0.1068365, 20: 0.1, 21: 0.55, 22: 1.0, 39: 0.1068365}),
    # the deprecated cooldown: a final linear decay to min_lr over int(0.2 x 20) = 4 steps
    "cooldown": ({"levanter_lr_schedule": "constant", "levanter_cooldown": 0.2, "levanter_warmup": 0}, 20,
                 {0: 1.0, 15: 1.0, 16: 1.0, 17: 0.775, 19: 0.325}),
}


@pytest.mark.parametrize("name", sorted(LEVANTER_POINTS))
def test_levanter_style_is_levanters_curve(name: str) -> None:
    keys, steps, points = LEVANTER_POINTS[name]
    got = curve("levanter", steps, **keys)
    for step, expected in points.items():
        assert got[step] == pytest.approx(expected, abs=3e-7), (name, step)


def test_levanter_cosine_is_interpolated_not_floored() -> None:
    """The issue's -36 % at 75 %: Levanter's cosine is min + (lr - min)(1 + cos)/2, GPT-NeoX's is floored."""
    ours = curve("levanter", 1000, levanter_warmup=0)[750]
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75))  # optax.cosine_decay_schedule, alpha = 0.1
    assert ours == pytest.approx(expected, rel=1e-12)
    assert ours == pytest.approx(0.23180194846605365)


def test_levanter_style_scales_with_lr() -> None:
    assert curve("levanter", 30, lr=3e-4) == pytest.approx([3e-4 * v for v in curve("levanter", 30)], rel=1e-12)


def test_levanter_cosine_without_decay_steps_is_refused() -> None:
    """optax.cosine_decay_schedule raises for decay_steps <= 0 (warmup: 1.0 leaves none)."""
    from megatron.config_rules import Device
    from megatron.neox_arguments import finalize

    resolved = config_from_mapping({"lr_decay_style": "levanter", "levanter_warmup": 1.0, "train_iters": 10, "lr": 1e-3,
                                    "train_micro_batch_size_per_gpu": 1, "seq_length": 8, "hidden_size": 8,
                                    "num_layers": 1, "num_attention_heads": 1, "use_dummy_dataset": True,
                                    "tokenizer_type": "CharLevelTokenizer"})
    with pytest.raises(ConfigError, match="decay steps > 0"):
        finalize(resolved, 1, device=Device(cuda=False, fp16_supported=False))


def fms_schedule(x: int, num_steps: int) -> float:
    """fms-fsdp's lambda, re-derived: warmup_interval = min(2000, num_steps // 20)."""
    w = min(2000, num_steps // 20)
    return min(1 - (1 - min(x, w) / w) ** 2, 0.1 + 0.5 * (1 - 0.1) * (1 + math.cos(min(x, num_steps) / num_steps * math.pi)))


@pytest.mark.parametrize("num_steps", [20, 39, 1000, 100_000])
def test_fms_style_is_fms_fsdps_curve(num_steps: int) -> None:
    steps = min(num_steps, 3000)
    got = curve("fms", num_steps, lr=3e-4, first=steps)
    assert got == pytest.approx([3e-4 * fms_schedule(x, num_steps) for x in range(steps)], rel=1e-12)


def test_fms_warmup_is_one_step_for_20_to_39_steps_not_the_whole_run() -> None:
    got = curve("fms", 30)
    assert got[0] == 0.0 and got[1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 30)))
    assert got[1] > 0.99  # the issue: warmup 1.0 had made the whole run a warmup
    at_1000 = curve("fms", 1000)
    assert at_1000[25] == pytest.approx(0.75)  # 1 - (1 - 25/50)^2, W = 50
    assert at_1000[999] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 999 / 1000)))


def test_fms_annealing_is_linear_to_zero_and_no_warmup() -> None:
    assert curve("fms_annealing", 10, lr=2.0) == pytest.approx([2.0 * (1 - x / 10) for x in range(10)])


def test_gpt_neox_schedule_keys_are_refused_beside_a_whole_curve_style() -> None:
    from megatron.config_rules import Device
    from megatron.neox_arguments import finalize

    resolved = config_from_mapping({"lr_decay_style": "fms", "warmup": 0.1, "min_lr": 1e-5, "train_iters": 10,
                                    "lr": 1e-3, "train_micro_batch_size_per_gpu": 1, "seq_length": 8, "hidden_size": 8,
                                    "num_layers": 1, "num_attention_heads": 1, "use_dummy_dataset": True,
                                    "tokenizer_type": "CharLevelTokenizer"})
    with pytest.raises(ConfigError, match=r"warmup=0.1 .*min_lr=1e-05 .*not read by lr_decay_style='fms'"):
        finalize(resolved, 1, device=Device(cuda=False, fp16_supported=False))
