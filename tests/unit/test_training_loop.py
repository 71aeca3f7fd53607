"""Single-process pieces of the trainer: batches, grad-norm clipping, overflow policy, layer
selection for checkpointing, pipeline partition names."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.errors import ConfigError
from megatron.model.pipeline import BLOCK_PARTITION
from megatron.neox_arguments import NeoXArgs, config_from_mapping
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.data.batch import RankBatch
from megatron.neox_arguments.run_config import RunConfig
from megatron.training.config import TrainingLoopArgs
from megatron.engine.build import clip_grad_norm, layers_to_checkpoint, partition_method
from megatron.training.loop import LoopHooks, TrainingAborted, TrainState, _check_overflow
from megatron.objectives.base import IGNORE_INDEX, shifted
from megatron.training.step import StepResult


def test_shifted_inputs_and_masked_labels() -> None:
    text = torch.tensor([[5, 6, 7, 0, 9]])
    tokens, labels = shifted({"text": text}, "text", "label", eod_token=0)
    assert tokens.tolist() == [[5, 6, 7, 0]]
    assert labels.tolist() == [[6, 7, IGNORE_INDEX, 9]]  # predicting the eod is not counted
    _, labels = shifted({"text": text, "label": torch.tensor([[-100, -100, 7, 3, 9]])}, "text", "label", None)
    assert labels.tolist() == [[IGNORE_INDEX, 7, 3, 9]]


def test_clip_grad_norm_matches_torch_and_clips() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    for model in (a, b):
        model(torch.randn(4, 8)).pow(2).sum().backward()
    params = [*a.parameters(), *b.parameters()]
    reference = [p.grad.clone() for p in params]
    expected = torch.nn.utils.get_total_norm(reference)
    norm = clip_grad_norm(params, max_norm=0.5)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    assert float(clipped) == pytest.approx(0.5, rel=1e-4)


def test_clip_skips_pipeline_replicas_of_tied_weights() -> None:
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    q.ds_pipe_replicated = True  # the copy DeepSpeed keeps on a non-owner stage
    assert clip_grad_norm([p, q], max_norm=0.0) == pytest.approx(5.0)


def _result(applied: bool) -> StepResult:
    return StepResult(loss=1.0, applied=applied, grad_norm=None, loss_scale=1.0)


def test_overflow_counting_and_abort() -> None:
    state = TrainState()
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(True), limit=3)  # a good step resets the streak
    assert state.skipped_steps == 2 and state.consecutive_overflows == 0
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(False), limit=3)
    with pytest.raises(TrainingAborted, match="max_consecutive_overflows"):
        _check_overflow(state, _result(False), limit=3)


def test_train_state_round_trip() -> None:
    state = TrainState(iteration=7, consumed_samples=56)
    assert TrainState.from_dict({**state.to_dict(), "unknown": 1}) == state


def _ckpt(**values: object) -> ActivationCheckpointArgs:
    return config_from_mapping(values).args


def test_layers_to_checkpoint() -> None:
    assert layers_to_checkpoint(_ckpt(checkpoint_activations=True), 4) == [0, 1, 2, 3]
    every_other = _ckpt(checkpoint_activations=True, selective_checkpointing=2)
    assert layers_to_checkpoint(every_other, 4) == [0, 2]
    # on a later pipeline stage holding global layers 3..5
    assert layers_to_checkpoint(every_other, 3, first_index=3) == [1]
    assert layers_to_checkpoint(_ckpt(), 4) == []


def test_activation_block_is_another_spelling_of_the_flat_keys() -> None:
    """DeepSpeed's ``activation_checkpointing`` block turns an option on as its flat key does, and only
    it sets ``number_checkpoints`` (else one buffer per layer)."""
    flat = _ckpt(checkpoint_activations=True, partition_activations=True).deepspeed_checkpointing_options(6)
    block = _ckpt(checkpoint_activations=True, activation_checkpointing={
        "partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3,
    }).deepspeed_checkpointing_options(6)
    assert (flat["partition_activations"], flat["checkpoint_in_cpu"], flat["num_checkpoints"]) == (True, False, 6)
    assert (block["partition_activations"], block["checkpoint_in_cpu"], block["num_checkpoints"]) == (True, True, 3)


def test_the_loop_gets_its_keys_and_the_shared_values_resolved() -> None:
    """``RunConfig.training``: the loop's own keys are its own instance of its group (no key of another group
    on it), and the keys other components declare arrive as resolved values; an unresolved batch is refused by
    name."""
    args = NeoXArgs(seq_length=32, seed=7, precision="bfloat16", train_micro_batch_size_per_gpu=3,
                    gradient_accumulation_steps=2, train_batch_size=6, eval_interval=5)
    training = RunConfig.from_args(args).training
    assert type(training.loop) is TrainingLoopArgs and training.loop.eval_interval == 5
    assert not hasattr(training.loop, "seq_length") and not hasattr(training.loop, "hidden_size")
    assert (training.seq_length, training.seed, training.precision) == (32, 7, "bfloat16")
    assert training.batch == RankBatch(micro=3, gas=2) and training.batch.on(dp=4).global_size == 24
    with pytest.raises(ConfigError, match="batch sizes"):
        RunConfig.from_args(args.model_copy(update={"train_micro_batch_size_per_gpu": None})).training


def test_partition_method_names() -> None:
    assert partition_method("type:transformer|mlp") == BLOCK_PARTITION  # blocks of every family
    assert partition_method("parameters") == "parameters"
    assert partition_method("type:Embedding") == "type:Embedding"
    with pytest.raises(ConfigError, match="pipe_partition_method"):
        partition_method("balanced")


def test_micro_batches_from_sampler_feed_the_shift() -> None:
    from megatron.data.sampler import collate

    samples = [{"text": np.arange(5, dtype=np.int64) + i} for i in range(2)]
    tokens, _ = shifted(collate(samples), "text", "label", None)
    assert tokens.shape == (2, 4) and tokens.dtype == torch.int64


# --- save before evaluating (issue 30: an evaluation that fails never costs its step's checkpoint) --------
class _Recorder:
    """The loop's collaborators as fakes that write down what happened, in order."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.events: list[str] = []
        self.fail_at = fail_at
        self.lr_scheduler = self
        self.engine = self
        self.moe = None

    # engine, scheduler and monitor
    def train(self) -> None: ...
    def get_last_lr(self) -> list[float]:
        return [0.1]
    def before_step(self, it: int) -> None: ...
    def after_step(self, it: int) -> None: ...
    def is_log_step(self, it: int) -> bool:
        return False
    def log(self, row: dict[str, object], it: int) -> None:
        self.events.append(f"logged {sorted(k for k in row if '/' in k and not k.startswith('timers/'))} @{it}")
    def discard_window(self) -> None: ...
    def message(self, text: str) -> None: ...

    # evaluations and hooks
    def tasks(self, state: TrainState) -> dict[str, float]:
        self.events.append(f"tasks @{state.iteration}")
        if state.iteration == self.fail_at:
            raise RuntimeError("the harness failed")
        return {"lm_eval/t/acc": 1.0}
    def save_every_2(self, eng: object, state: TrainState) -> bool:
        if state.iteration % 2 == 0:
            self.events.append(f"saved @{state.iteration}")
        return False
    def at_exit(self, eng: object, state: TrainState) -> None:
        self.events.append(f"at_exit @{state.iteration} ({state.stop_reason})")


def _run_loop(monkeypatch: pytest.MonkeyPatch, rec: _Recorder, train_iters: int, *extra: LoopHooks,
              **training: object) -> TrainState:
    """The loop with a save every 2 steps and the lm-eval tasks' hooks (``features/tasks.py``), then ``extra``."""
    from megatron.training import loop
    from megatron.training.features.tasks import build_tasks

    state = TrainState()
    monkeypatch.setattr(loop, "train_step", lambda eng, micro, device, seq_limit=None: _result(True))
    args = NeoXArgs(**{"eval_interval": 2, "exit_interval": None, "seq_length": 8, "train_batch_size": 1,
                       "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, **training})
    run = RunConfig.from_args(args)

    class Tasks:  # train.py's TasksInTraining, its runner writing down when it ran
        interval = args.eval_tasks_interval

        def __call__(self, eng: object, tokenizer: object, zero_stage: int, sequence_parallel: bool) -> Tasks:
            return self

        def run(self) -> dict[str, float]:
            return rec.tasks(state)

    tasks = build_tasks(run, SimpleNamespace(task_evaluation=Tasks(), eng=rec, tokenizer=None, zero_stage=0))  # type: ignore[arg-type]
    assert tasks is not None
    ctx = loop.LoopContext(eng=rec, training=args, micro_batches=iter(()), device=torch.device("cpu"),  # type: ignore[arg-type]
                           train_iters=train_iters, global_batch_size=1, tokens_per_step=1, flops_per_token=1.0,
                           world_size=1, peak_tflops=None, monitor=rec)  # type: ignore[arg-type]
    saves = LoopHooks(name="saves", after_step=rec.save_every_2, at_exit=rec.at_exit)
    return loop.train(ctx, state, loop.Hooks([saves, tasks, *extra]))


def test_a_step_is_saved_before_its_evaluation_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder(fail_at=4)
    with pytest.raises(RuntimeError, match="the harness failed"):
        _run_loop(monkeypatch, rec, train_iters=6)
    assert rec.events == ["saved @2", "tasks @2", "logged ['lm_eval/t/acc'] @2", "saved @4", "tasks @4"]


def test_the_last_step_is_saved_before_the_final_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder(fail_at=3)
    with pytest.raises(RuntimeError, match="the harness failed"):
        _run_loop(monkeypatch, rec, train_iters=3, eval_interval=10)
    assert rec.events == ["saved @2", "at_exit @3 (train_iters reached)", "tasks @3"]
    # exit_interval ends the run early: at_exit saves that step, then the step's evaluations run
    rec = _Recorder()
    state = _run_loop(monkeypatch, rec, train_iters=9, eval_interval=3, exit_interval=3)
    assert rec.events == ["saved @2", "at_exit @3 (exit_interval 3)", "tasks @3", "logged ['lm_eval/t/acc'] @3"]
    assert state.iteration == 3


def test_eval_tasks_interval_runs_the_tasks_on_their_own_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """eval_tasks_interval (Levanter's eval_harness_steps): every 3 steps and after the last, whatever eval_interval."""
    rec = _Recorder()
    _run_loop(monkeypatch, rec, train_iters=7, eval_interval=2, eval_tasks_interval=3)
    assert [e for e in rec.events if e.startswith("tasks")] == ["tasks @3", "tasks @6", "tasks @7"]


def test_comms_logger_summary_at_the_end_and_with_verbose_at_log_steps() -> None:
    """comms_logger (DeepSpeed's block): its summary after the last step; with verbose also every log_interval."""
    from megatron.training.comms_report import CommsReport

    def shown(block: dict[str, object] | None) -> list[int]:
        steps: list[int] = []
        report = CommsReport(block, log_interval=2, show=lambda: steps.append(state.iteration))
        state = TrainState()
        for state.iteration in range(1, 6):
            assert report.after_step(None, state) is False
        report.at_exit(None, state)
        return steps

    assert shown(None) == [] and shown({"enabled": False, "verbose": True}) == []
    assert shown({"enabled": True}) == [5]
    assert shown({"enabled": True, "verbose": True}) == [2, 4, 5]


def test_the_features_events_come_in_their_order_and_evaluations_read_the_evaluated_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every feature's ``resume`` before the first step, its ``after_update`` before any ``after_step`` (the step's
    checkpoint holds the EMA of that step), ``log_metrics`` into the log row, then the saves, ``at_exit``, and the
    evaluations, the features' inside the evaluated weights (the EMA's: Levanter's ``eval_model``)."""
    import contextlib
    from collections.abc import Iterator

    from megatron.training.loop import EvalWeights

    rec = _Recorder()
    rec.is_log_step = lambda it: it == 2  # type: ignore[method-assign]
    rec.window_metrics = lambda steps: {}  # type: ignore[attr-defined]
    told: list[float] = []
    rec.before_update = None  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def swapped_in() -> Iterator[None]:
        rec.events.append("ema in")
        yield
        rec.events.append("ema out")

    ema = LoopHooks(name="ema", resume=lambda eng, state: rec.events.append(f"ema resume @{state.iteration}"),
                    before_update=lambda loss: told.append(float(loss)),
                    after_update=lambda eng, state: rec.events.append(f"ema update @{state.iteration}"),
                    log_metrics=lambda eng, state: {"ema/seen": float(state.iteration)},
                    eval_weights=EvalWeights(tag="ema", swapped_in=swapped_in, whole=lambda keep: {}))
    state = _run_loop(monkeypatch, rec, 2, ema, eval_interval=10)
    logged = [e for e in rec.events if e.startswith("logged") and "ema/seen" in e]
    assert len(logged) == 1 and logged[0].endswith("@2")
    assert [e for e in rec.events if not e.startswith("logged")] == [
        "ema resume @0", "ema update @1", "ema update @2", "saved @2", "at_exit @2 (train_iters reached)",
        "ema in", "tasks @2", "ema out"]
    assert state.iteration == 2
    rec.before_update(torch.tensor(3.0))  # type: ignore[attr-defined]  # the loop handed the engine the features'
    assert told == [3.0]
