"""``ema_beta``: the weight average after k real optimizer steps against a direct computation, evaluation on
the average, and its checkpoint file.

Facts from stanford-crfm/levanter 9263f81e, ``src/levanter/optim/model_averaging.py``: ``EmaModelAveraging``
starts at the initial trainable weights and ``update`` returns ``optax.incremental_update(new, ema, 1 - beta)``,
i.e. ``(1 - beta) * new + beta * ema`` - no bias correction, no warmup; ``trainer_state.py`` ``take_step``
updates it after every step.
"""

from __future__ import annotations

import pytest
import torch

from megatron.errors import CheckpointError
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.model_averaging import EMA_DIR, ModelAverage


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    import deepspeed

    from single_rank import init_single_rank_gloo

    init_single_rank_gloo()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)  # frozen: not averaged (Levanter averages trainables_only)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=model, config=config,
                                   optimizer=torch.optim.AdamW([model.weight], lr=0.05, weight_decay=0.1))
    return eng


def test_the_average_after_k_steps_is_the_closed_form_of_the_recorded_weights(engine) -> None:  # type: ignore[no-untyped-def]
    beta, k = ModelAveragingArgs(ema_beta=0.7).ema_beta, 5
    assert beta is not None
    average = ModelAverage(engine.module, beta)
    assert set(average.average) == {"weight"}
    recorded = [engine.module.weight.detach().double().clone()]
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    for _ in range(k):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        average.update()
        recorded.append(engine.module.weight.detach().double().clone())
    # ema_k = beta^k w_0 + sum_{t=1..k} (1 - beta) beta^(k - t) w_t
    expected = beta**k * recorded[0] + sum((1 - beta) * beta ** (k - t) * recorded[t] for t in range(1, k + 1))
    torch.testing.assert_close(average.average["weight"].double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(expected, recorded[-1])  # the average is not the weights

    weights = engine.module.weight.detach().clone()
    with average.swapped_in():
        torch.testing.assert_close(engine.module.weight.detach(), average.average["weight"])
        out = engine.module(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, average.average["weight"], engine.module.bias))
    assert torch.equal(engine.module.weight, weights)  # the training weights are back


def test_checkpoint_file_round_trip_and_a_layout_change_is_refused(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    layout = {"tp": 1, "pp": 1, "pipeline": False}
    saved = ModelAverage(engine.module, 0.9, layout=layout)
    saved.average["weight"].add_(1.5)  # differs from the weights
    saved.save(tmp_path)
    assert (tmp_path / EMA_DIR / "tp00_pp00.pt").is_file()
    resumed = ModelAverage(engine.module, 0.9, layout=layout)
    assert resumed.load(tmp_path)
    assert torch.equal(resumed.average["weight"], saved.average["weight"])
    assert ModelAverage(engine.module, 0.9, layout=layout).load(tmp_path / "none") is False  # saved without one
    other = ModelAverage(engine.module, 0.9, layout={**layout, "tp": 2})
    with pytest.raises(CheckpointError, match="ema_beta"):
        other.load(tmp_path)
    ModelAverage(engine.module, 0.9, layout=layout, writer=False).save(tmp_path / "replica")
    assert not (tmp_path / "replica").exists()  # data-parallel replicas hold the same average: one writes


def test_evaluations_report_both_and_tasks_run_on_the_average(engine) -> None:  # type: ignore[no-untyped-def]
    """Levanter's eval.py logs eval/loss and eval/ema/loss; its eval harness reads ``eval_model`` (the average)."""
    from types import SimpleNamespace

    from megatron.training.loop import Evaluation, EvalWeights, Hooks, LoopHooks, TrainState, evaluate_now
    from megatron.training.loop import run_evaluation

    average = ModelAverage(engine.module, 0.5)
    average.average["weight"].fill_(0.25)
    weights = engine.module.weight.detach().clone()
    seen: list[torch.Tensor] = []
    rows: list[dict[str, float]] = []

    def tasks() -> dict[str, float]:
        seen.append(engine.module.weight.detach().clone())
        return {"lm_eval/task/acc": 1.0}

    ema = EvalWeights(tag="ema", swapped_in=average.swapped_in, whole=average.whole)
    tasks_evaluation = Evaluation(due=lambda iteration, last: True, run=tasks)
    hooks = Hooks([LoopHooks(name="ema", eval_weights=ema), LoopHooks(name="eval_tasks", evaluation=tasks_evaluation)])
    monitor = SimpleNamespace(log=lambda row, step: rows.append(row), discard_window=lambda: None)
    ctx = SimpleNamespace(monitor=monitor, training=SimpleNamespace(eval_interval=10))
    run_evaluation(ctx, TrainState(iteration=3), tasks_evaluation, hooks)  # type: ignore[arg-type]
    assert torch.all(seen[0] == 0.25) and torch.equal(engine.module.weight, weights)
    evaluator = SimpleNamespace(evaluate=lambda number: {"lm_loss": float(engine.module.weight.detach().sum())})
    evaluate_now(ctx, TrainState(iteration=3), evaluator, "eval", hooks.eval_weights)  # type: ignore[arg-type]
    assert rows[-1]["eval/ema/lm_loss"] == pytest.approx(0.25 * weights.numel())
    assert rows[-1]["eval/lm_loss"] == pytest.approx(float(weights.sum()))


def test_split_experts_are_refused_by_name_and_zero3_is_accepted() -> None:
    """ZeRO-3 averages each rank's partitions (tests/distributed/test_model_averaging_zero3.py); experts split over
    data-parallel ranks and parameters offloaded to NVMe (swapped out of memory between steps) are refused, and so is
    an optimizer offloaded to NVMe under bf16 (the average follows its fp32 master partitions)."""
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.derived import finalize
    from megatron.config_rules import Device
    from megatron.errors import ConfigError

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
                train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                ema_beta=0.99)
    device = Device(cuda=False, fp16_supported=False)
    finalize(config_from_mapping({**base, "zero_optimization": {"stage": 2}}), 1, device=device)
    finalize(config_from_mapping({**base, "zero_optimization": {"stage": 3}}), 2, device=device)
    with pytest.raises(ConfigError, match="ema_beta=0.99 .*offload_param.device nvme"):
        finalize(config_from_mapping({**base, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}), 2, device=device)
    optimizer_on_nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError, match="ema_beta=0.99 .*offload_optimizer.device nvme: under bfloat16"):
        finalize(config_from_mapping({**base, "precision": "bfloat16", "zero_optimization": optimizer_on_nvme}), 2,
                 device=device)
    finalize(config_from_mapping({**base, "zero_optimization": optimizer_on_nvme}), 2, device=device)  # fp32: none
    with pytest.raises(ConfigError, match="ema_beta=0.99 .*moe_expert_parallel_size=2"):
        finalize(config_from_mapping({**base, "moe_num_experts": 2, "moe_expert_parallel_size": 2}), 2, device=device)
