"""``skip_bad_steps``: Levanter's rule re-derived here, and a real DeepSpeed step that it skips.

Facts from stanford-crfm/levanter 9263f81e, ``src/levanter/optim/skipstep.py``: a circular buffer of the last
``rolling_interval_length`` (loss, grad norm) pairs with a validity mask; before a step,
``threshold = mean + sigma_factor * max(std, 1e-6)`` over the valid entries (``jnp.std``: population std);
skip when ``not (loss <= loss_threshold and norm <= norm_threshold)`` and ``count >= max(2, length // 2)``;
the pair then enters the buffer either way. A skipped step zeroes the update and keeps the inner optimizer
state (``jnp.where(step_factor == 0, old, new)``); ``optim/config.py`` ``AdamConfig.build`` wraps the chain
inside ``optax.inject_hyperparams``, whose count (the LR schedule's step) advances on every update.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron.training.bad_steps import BadStepArgs, BadStepRule


def _levanter_verdicts(losses: list[float], norms: list[float], length: int, sigma: float) -> list[bool]:
    """skipstep.py's update_fn, step by step, with its own buffer/mask/index bookkeeping (float32 as there)."""
    buf_l = np.zeros(length, np.float32)
    buf_n = np.zeros(length, np.float32)
    valid = np.zeros(length, bool)
    idx = count = 0
    out = []
    for loss, norm in zip(losses, norms):
        with np.errstate(invalid="ignore"):
            lm, ls = (buf_l[valid].mean(), buf_l[valid].std()) if valid.any() else (np.nan, np.nan)
            nm, ns = (buf_n[valid].mean(), buf_n[valid].std()) if valid.any() else (np.nan, np.nan)
        lt, nt = lm + sigma * max(ls, 1e-6), nm + sigma * max(ns, 1e-6)
        should_skip = not (loss <= lt and norm <= nt)
        out.append(bool(count >= max(2, length // 2) and should_skip))
        buf_l[idx], buf_n[idx], valid[idx] = loss, norm, True
        idx, count = (idx + 1) % length, min(count + 1, length)
    return out


def test_rule_matches_levanters_arithmetic_on_a_loss_sequence() -> None:
    rng = np.random.default_rng(0)
    losses = list(3.0 + 0.05 * rng.standard_normal(40))
    norms = list(1.0 + 0.02 * rng.standard_normal(40))
    losses[3] = 50.0  # before the window holds length // 2 entries: taken
    losses[12] = 9.0  # a loss spike
    norms[20] = 40.0  # a gradient-norm spike
    losses[30] = math.nan  # a NaN fails every comparison
    rule = BadStepArgs(skip_bad_steps_window=8, skip_bad_steps_sigma=3.0).bad_step_rule()
    assert rule is not None and BadStepArgs().bad_step_rule() is None  # no window: no rule
    ours = [rule.judge(loss, norm).skip for loss, norm in zip(losses, norms)]
    assert ours == _levanter_verdicts(losses, norms, 8, 3.0)
    assert ours[3] is False and ours[12] and ours[20] and ours[30]
    assert rule.skipped == sum(ours)
    # the window keeps the newest entries only, skipped steps' included, and round-trips through a checkpoint
    assert len(rule.losses) == 8 and rule.norms[-1] == norms[-1]
    resumed = BadStepRule(window=8, sigma=3.0)
    resumed.restore(rule.to_dict())
    assert resumed.judge(100.0, 1.0).skip == rule.judge(100.0, 1.0).skip


def test_the_threshold_is_the_mean_plus_sigma_population_stds() -> None:
    rule = BadStepRule(window=4, sigma=2.0)
    for loss in (1.0, 3.0):
        rule.judge(loss, 1.0)
    verdict = rule.judge(5.0, 1.0)  # mean 2, population std 1: threshold 4
    assert verdict.loss_threshold == pytest.approx(4.0) and verdict.skip
    assert verdict.norm_threshold == pytest.approx(1.0 + 2.0 * 1e-6)  # std 0 is floored at 1e-6


@pytest.fixture(scope="module")
def dist_ready() -> None:
    from single_rank import init_single_rank_gloo

    init_single_rank_gloo()


def _engine(zero_stage: int):  # type: ignore[no-untyped-def]
    import deepspeed

    from megatron.deepspeed_internals import replace_fp32_clipping

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "zero_optimization": {"stage": zero_stage}}
    eng, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if zero_stage == 0:  # what the trainer installs (engine/build.py install_fp32_clipping): records the norm
        params = list(eng.module.parameters())
        replace_fp32_clipping(eng, lambda: float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
    return eng


def _adam_state(eng) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    state = eng.basic_optimizer.state
    return [t.clone() for p in state for t in state[p].values() if torch.is_tensor(t)]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_skipped_step_changes_no_weight_nor_adam_state_and_the_lr_moves_on(dist_ready, zero_stage) -> None:  # type: ignore[no-untyped-def]
    from megatron.training.skip_gate import BadStepGate

    eng = _engine(zero_stage)
    rule = BadStepArgs(skip_bad_steps_window=4).bad_step_rule()  # sigma 6.0 by default
    assert rule is not None
    gate = BadStepGate(eng, rule)
    x, y = torch.randn(2, 4), torch.randn(2, 3)

    def step(reported_loss: float) -> None:
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        gate.set_loss(torch.tensor(reported_loss))  # what the objective runner hands over before the update
        eng.step()

    for _ in range(3):
        step(1.0)
    assert gate.last is not None and not gate.last.skip
    weights = [p.detach().clone() for p in eng.module.parameters()]
    adam, lr = _adam_state(eng), eng.lr_scheduler.get_last_lr()[0]
    step(1e6)  # far above the window of 1.0s
    assert gate.last.skip and gate.rule.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, eng.module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(adam, _adam_state(eng)))
    assert eng.lr_scheduler.get_last_lr()[0] < lr  # the schedule advanced (Levanter's inject_hyperparams count)
    assert gate.rule.norms[-1] == pytest.approx(float(eng.get_global_grad_norm()))  # DeepSpeed's pre-clip norm
    step(1.0)  # the next ordinary step applies its update
    assert not gate.last.skip
    assert not all(torch.equal(a, b) for a, b in zip(weights, eng.module.parameters()))


def test_sigma_alone_and_a_pipeline_are_refused_by_name() -> None:
    from megatron.config_rules import Device
    from megatron.errors import ConfigError
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.derived import finalize

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
                train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")
    device = Device(cuda=False, fp16_supported=False)
    finalize(config_from_mapping({**base, "skip_bad_steps_window": 8}), 1, device=device)
    with pytest.raises(ConfigError, match="skip_bad_steps_sigma=3.0 .*without skip_bad_steps_window"):
        finalize(config_from_mapping({**base, "skip_bad_steps_sigma": 3.0}), 1, device=device)
    with pytest.raises(ConfigError, match="skip_bad_steps_window=8 .*pipe_parallel_size=1"):
        finalize(config_from_mapping({**base, "skip_bad_steps_window": 8, "pipe_parallel_size": 1}), 1, device=device)
