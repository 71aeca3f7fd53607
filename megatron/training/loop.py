"""The training loop: steps, evaluation, logging, stopping, and the hooks the features plug in through.

State that must survive a restart is in :class:`TrainState`; the data position is a pure function
of ``consumed_samples`` and each evaluation's position a pure function of the iteration, so resuming
needs nothing else. Every feature (checkpoints, the EMA, the bad-step rule, extra saves, lm-eval tasks,
...: ``megatron/training/features/``) plugs in through its :class:`LoopHooks`, and the loop calls each
event of every feature in the features' order (:class:`Hooks`), never a feature by name: ``resume``
before the first step, ``after_update`` after each optimizer step, ``log_metrics`` at log steps,
``after_step`` (save by iteration or wall clock, preemption; may ask the loop to stop), the features'
evaluations, and ``at_exit`` once after the last step (it saves that step when no ``after_step`` did).

Saving comes before evaluating: at a step that is saved, the hooks run before that step's evaluations
(validation, test, ``eval_tasks``), and at the step that ends the run ``at_exit`` does too, so an
evaluation that fails never costs the checkpoint of its step. A stop asked by a hook (preemption)
skips the evaluations of that step: the time left goes to exiting cleanly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from megatron.data.batch_schedule import BatchSchedule
from megatron.errors import DeepyError
from megatron.logging.monitor import Monitor
from megatron.logging.peak_memory import memory_metrics
from megatron.logging.throughput import as_metrics, measure
from megatron.training.config import TrainingLoopArgs
from megatron.training.curriculum import SeqlenCurriculum
from megatron.engine.build import Engine
from megatron.training import hang_watch
from megatron.training.evaluate import Evaluator, evaluation_number
from megatron.training.step import StepResult, read_grad_norm, train_step


class TrainingAborted(DeepyError):
    """Training cannot usefully continue (e.g. fp16 overflowing step after step)."""

    kind = "training aborted"


@dataclass
class TrainState:
    """Everything about the run's progress that a checkpoint stores besides the engine's tensors."""

    iteration: int = 0
    """Optimizer steps taken (including fp16-skipped ones: they consumed their batch)."""
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0
    consecutive_overflows: int = 0
    stop_reason: str | None = None
    wandb_run_id: str | None = None
    """The W&B run this training logs to; a resumed run continues it."""
    run_name: str | None = None
    """Named at the run's first launch; its metrics.jsonl is ``<log_dir>/<run_name>/metrics.jsonl``,
    which a resumed run continues."""
    bad_steps: dict[str, Any] | None = None
    """The bad-step rule's window (``skip_bad_steps_window``): the last steps' losses and gradient norms."""
    stream: dict[str, Any] | None = None
    """``streaming``: each logical stream's position at ``consumed_samples`` (``StreamingDataset.state_at``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# after_step returns True to stop the loop (e.g. a preemption signal was received)
StepHook = Callable[[Engine, TrainState], Any]


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """An evaluation a feature runs after a step: after the step's validation, before its test evaluation, on the
    evaluated weights (:attr:`Hooks.eval_weights`), logged as a row of its own."""

    due: Callable[[int, bool], bool]
    """``(iteration, last)`` -> whether it runs after this step (``last``: the run's last step)."""
    run: Callable[[], dict[str, float]]
    """The row's metrics under their full names (``lm_eval/<task>/<metric>``), the same on every rank."""


@dataclass(frozen=True, kw_only=True)
class EvalWeights:
    """Weights a feature keeps beside the trained ones (the EMA): every evaluation also reports them
    (``eval/<tag>/lm_loss``), and the features' evaluations and saves read them instead (Levanter's ``eval_model``)."""

    tag: str
    swapped_in: Callable[[], AbstractContextManager[None]]
    """A block inside which the module holds these weights (every rank enters it)."""
    whole: Callable[[bool], dict[str, torch.Tensor]]
    """The weights as whole tensors under the module's names (every rank calls it; the argument: this rank keeps
    them, the others get an empty dict)."""


@dataclass(frozen=True, kw_only=True)
class LoopHooks:
    """One feature's events in the loop, each optional and called on every rank with the engine and the loop's
    state; a feature's builder (``features/``) returns them."""

    name: str
    """The feature (its key, as the user writes it)."""
    resume: StepHook | None = None
    """Once, before the first step (a fresh start too), after the checkpoint load: take up the loaded state."""
    before_update: Callable[[torch.Tensor], None] | None = None
    """Told each step's loss (a 0-dim tensor, the same on every rank) inside the step, before the optimizer applies
    the update (``Engine.before_update``)."""
    after_update: StepHook | None = None
    """After each optimizer step, applied or skipped; every feature's runs before any ``after_step``, so the step's
    checkpoint holds what it updates."""
    log_metrics: Callable[[Engine, TrainState], dict[str, float]] | None = None
    """At log steps (a collective may run here: every rank calls it): metrics added to the row."""
    after_step: StepHook | None = None
    """After the step's log row and before its evaluations (saves); returns True to stop the loop."""
    at_exit: StepHook | None = None
    """Once, after the last step (also when the loop ran none), before that step's evaluations."""
    evaluation: Evaluation | None = None
    eval_weights: EvalWeights | None = None


class Hooks:
    """The features' hooks in their order (``features.FEATURES``); each event calls every feature's, in order."""

    def __init__(self, features: Sequence[LoopHooks] = ()) -> None:
        self.features = tuple(features)
        weights = [hooks.eval_weights for hooks in self.features if hooks.eval_weights is not None]
        if len(weights) > 1:
            raise ValueError(f"two features keep evaluation weights ({', '.join(w.tag for w in weights)}): one can")
        self.eval_weights = weights[0] if weights else None
        self.evaluations = [hooks.evaluation for hooks in self.features if hooks.evaluation is not None]
        self._told_loss = [hooks.before_update for hooks in self.features if hooks.before_update is not None]

    @property
    def want_loss(self) -> bool:
        """A feature is told each step's loss before the update (:meth:`before_update`)."""
        return bool(self._told_loss)

    def before_update(self, loss: torch.Tensor) -> None:
        for told in self._told_loss:
            told(loss)

    def _each(self, event: str, eng: Engine, state: TrainState) -> list[Any]:
        calls = [getattr(hooks, event) for hooks in self.features]
        return [call(eng, state) for call in calls if call is not None]

    def resume(self, eng: Engine, state: TrainState) -> None:
        self._each("resume", eng, state)

    def after_update(self, eng: Engine, state: TrainState) -> None:
        self._each("after_update", eng, state)

    def log_metrics(self, eng: Engine, state: TrainState) -> dict[str, float]:
        return {name: value for metrics in self._each("log_metrics", eng, state) for name, value in metrics.items()}

    def after_step(self, eng: Engine, state: TrainState) -> bool:
        """True when a feature asks the loop to stop (every feature's hook runs all the same)."""
        return any(bool(stop) for stop in self._each("after_step", eng, state))

    def at_exit(self, eng: Engine, state: TrainState) -> None:
        self._each("at_exit", eng, state)

    def evaluated(self) -> AbstractContextManager[None]:
        """A block on the evaluated weights (the EMA's), else on the trained ones."""
        return self.eval_weights.swapped_in() if self.eval_weights is not None else contextlib.nullcontext()


@dataclass
class _Window:
    """Accumulates steps between two log lines."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    loss_sum: float | torch.Tensor = 0.0  # a device tensor once a step added to it: read at log steps only
    loss_count: int = 0
    tokens: int = 0
    samples: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)

    lr: float = 0.0

    def add(self, result: StepResult, lr: float, samples: int, tokens: int) -> None:
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.lr = lr
        if result.applied:
            self.loss_sum += result.loss
            self.loss_count += 1
            for name, value in result.metrics.items():  # the objective's (train/rewards/accuracy, ...)
                self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value
                self.metric_counts[name] = self.metric_counts.get(name, 0) + 1


@dataclass
class LoopContext:
    eng: Engine
    training: TrainingLoopArgs
    micro_batches: Iterator[dict[str, torch.Tensor]]
    device: torch.device
    train_iters: int
    global_batch_size: int
    """Step 0's global batch (``train_batch_size``)."""
    tokens_per_step: int
    """Step 0's tokens."""
    flops_per_token: float
    world_size: int
    peak_tflops: float | None
    monitor: Monitor
    valid: Evaluator | None = None
    test: Evaluator | None = None
    hardware_flops_per_token: float | None = None
    """flops_per_token plus recomputed forwards (activation checkpointing), for HFU."""
    end_reason: str = "train_iters reached"
    """Why the run ends at ``train_iters`` (the last step: train_iters, or where max_train_epochs end)."""
    schedule: BatchSchedule | None = None
    """Each step's global batch (``train_batch_size_schedule``); None: ``global_batch_size`` every step."""
    curriculum: SeqlenCurriculum | None = None
    """Each step's tokens per sample (``curriculum_learning``); None: the whole ``seq_length`` every step."""

    def step_batch(self, iteration: int) -> tuple[int, int]:
        """Samples and tokens of 0-based step ``iteration``."""
        if self.schedule is None:
            return self.global_batch_size, self.tokens_per_step
        samples = self.schedule.batch_at(iteration)
        return samples, self.tokens_per_step // self.global_batch_size * samples


def _sync() -> None:
    try:
        get_accelerator().synchronize()
    except Exception:  # CPU accelerators without a synchronize are already synchronous
        pass


def _check_overflow(state: TrainState, result: StepResult, limit: int) -> None:
    if result.applied:
        state.consecutive_overflows = 0
        return
    state.skipped_steps += 1
    state.consecutive_overflows += 1
    if state.consecutive_overflows >= limit:
        raise TrainingAborted(
            f"{state.consecutive_overflows} optimizer steps in a row were skipped because fp16 gradients "
            f"overflowed (loss scale {result.loss_scale}) at iteration {state.iteration}. The run is "
            f"diverging or the loss scale cannot go lower: lower the learning rate, use precision: "
            f"bfloat16, or raise max_consecutive_overflows (now {limit})"
        )


def log_row(ctx: LoopContext, state: TrainState, window: _Window, result: StepResult) -> dict[str, Any]:
    _sync()
    seconds = time.perf_counter() - window.start
    row: dict[str, Any] = {"iteration": state.iteration, "consumed_samples": state.consumed_samples}
    if window.loss_count:
        row["train/lm_loss"] = float(window.loss_sum) / window.loss_count
    row.update({f"train/{name}": total / window.metric_counts[name] for name, total in window.metric_sums.items()})
    row["train/lr"] = window.lr  # the rate the last step used (the scheduler already moved on)
    grad_norm = read_grad_norm(result.grad_norm)
    if grad_norm is not None:
        row["train/grad_norm"] = grad_norm
    if result.loss_scale is not None:
        row["train/loss_scale"] = result.loss_scale
    if ctx.eng.moe is not None:
        row.update(ctx.eng.moe.metrics())  # router statistics (a collective: every rank logs)
    row["train/skipped_steps"] = state.skipped_steps
    row["train/consumed_tokens"] = state.consumed_tokens
    if ctx.curriculum is not None:  # GPT-NeoX's curriculum_seqlen (megatron/logging.py)
        row["train/curriculum_seqlen"] = ctx.curriculum.current
    if ctx.schedule is not None:  # the batch DeepSpeed ran the last step with (its accumulation = the micro-batch count)
        row["train/global_batch"] = int(ctx.eng.engine.train_batch_size())
    steps = max(window.steps, 1)  # the window's steps' own batches (a batch schedule changes them)
    row.update(as_metrics(measure(tokens_per_iter=round(window.tokens / steps), iterations=window.steps,
                                  seconds=seconds, flops_per_token=ctx.flops_per_token, world_size=ctx.world_size,
                                  peak=ctx.peak_tflops, samples_per_iter=round(window.samples / steps),
                                  hardware_flops_per_token=ctx.hardware_flops_per_token)))
    row.update(ctx.monitor.window_metrics(window.steps))
    row.update(memory_metrics())
    return row


def evaluate_now(ctx: LoopContext, state: TrainState, evaluator: Evaluator, prefix: str,
                 weights: EvalWeights | None = None) -> None:
    """``evaluator`` on the trained weights, and on ``weights`` too when a feature keeps them (``<prefix>/<tag>/...``)."""
    start = time.perf_counter()
    # validation: the k-th evaluation reads the k-th block of batches; test runs once, from the start
    number = evaluation_number(state.iteration, ctx.training.eval_interval) if prefix == "eval" else 0
    metrics = evaluator.evaluate(number)  # lm_loss (the objective's loss) and the objective's metrics
    if weights is not None:  # Levanter evaluates both: eval/loss and eval/ema/loss
        with weights.swapped_in():
            metrics.update({f"{weights.tag}/{name}": value for name, value in evaluator.evaluate(number).items()})
    row = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
           **{f"{prefix}/{name}": value for name, value in metrics.items()},
           f"timers/{prefix}_ms": 1000.0 * (time.perf_counter() - start)}
    ctx.monitor.log(row, state.iteration)
    ctx.monitor.discard_window()  # evaluation forwards are not the next window's training time


def run_evaluation(ctx: LoopContext, state: TrainState, evaluation: Evaluation, hooks: Hooks) -> None:
    """A feature's evaluation, on the evaluated weights (Levanter runs lm-eval on ``TrainerState.eval_model``)."""
    with hooks.evaluated():
        results = evaluation.run()
    row = {"iteration": state.iteration, "consumed_samples": state.consumed_samples, **results}
    ctx.monitor.log(row, state.iteration)
    ctx.monitor.discard_window()


def _evaluate_step(ctx: LoopContext, state: TrainState, hooks: Hooks, eval_interval: int | None) -> bool:
    """The evaluations due after this step: every ``eval_interval`` steps, the features' when they are due, and
    the last validation and the test split after the last step. True when any ran."""
    periodic = bool(eval_interval) and state.iteration % int(eval_interval or 1) == 0
    last = state.iteration == ctx.train_iters
    ran = False
    if ctx.valid is not None and (periodic or last):
        evaluate_now(ctx, state, ctx.valid, "eval", hooks.eval_weights)
        ran = True
    for evaluation in hooks.evaluations:
        if evaluation.due(state.iteration, last):
            run_evaluation(ctx, state, evaluation, hooks)
            ran = True
    if ctx.test is not None and last:
        evaluate_now(ctx, state, ctx.test, "test", hooks.eval_weights)
        ran = True
    return ran


def beating(batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """``batches``, with this rank's heartbeat in phase "data" while it waits for one, "forward/backward" after."""
    while True:
        hang_watch.beat("data")
        try:
            batch = next(batches)
        except StopIteration:
            return
        hang_watch.beat("forward/backward")
        yield batch


def train(ctx: LoopContext, state: TrainState, hooks: Hooks) -> TrainState:
    """Run from ``state`` until ``train_iters``, ``exit_interval`` or a hook says stop."""
    hooks.resume(ctx.eng, state)  # e.g. the EMA read back, a save a killed run left missing written now
    if hooks.want_loss:
        ctx.eng.before_update = hooks.before_update  # the objective runner calls it inside each step
    watch = hang_watch.current()
    micro_batches = beating(ctx.micro_batches) if watch is not None else ctx.micro_batches
    first = True
    eval_interval = ctx.training.eval_interval
    exit_interval = ctx.training.exit_interval
    limit = ctx.training.max_consecutive_overflows
    ctx.eng.engine.train()
    window = _Window()
    exited = False
    last_length: int | None = None
    while state.iteration < ctx.train_iters:
        lr = ctx.eng.lr_scheduler.get_last_lr()[0]
        ctx.monitor.before_step(state.iteration + 1)
        samples, tokens = ctx.step_batch(state.iteration)
        if ctx.schedule is not None and samples != ctx.eng.engine.train_batch_size():
            # the micro batch stays, DeepSpeed's accumulation steps (the objective's micro-batch count) follow
            ctx.eng.engine.set_train_batch_size(samples)
        seq_limit = None
        if ctx.curriculum is not None:
            seq_limit = ctx.curriculum.length_at(state.iteration + 1)  # GPT-NeoX: update_difficulty(iteration + 1)
            if ctx.eng.is_pipe and seq_limit != last_length:
                ctx.eng.engine.reset_activation_shape()  # the stages' buffers were sized for the last length
            last_length = seq_limit
            tokens = tokens // ctx.curriculum.seq_length * seq_limit
        hang_watch.beat("data", state.iteration)
        result = train_step(ctx.eng, micro_batches, ctx.device, seq_limit)
        state.iteration += 1
        hang_watch.beat("save", state.iteration)  # the step's hooks: checkpoint and HF saves
        if first and watch is not None:
            watch.first_step_done()  # torchtitan's train_timeout_seconds from here on
        first = False
        state.consumed_samples += samples
        state.consumed_tokens += tokens
        hooks.after_update(ctx.eng, state)  # after every step, skipped or not (Levanter's take_step)
        log_step = ctx.monitor.is_log_step(state.iteration)
        ctx.monitor.after_step(state.iteration)
        window.add(result, lr, samples, tokens)
        _check_overflow(state, result, limit)

        if log_step:
            row = log_row(ctx, state, window, result)
            row.update(hooks.log_metrics(ctx.eng, state))  # may be a collective: every rank at log steps
            ctx.monitor.log(row, state.iteration)
            window = _Window()

        # the step's checkpoint first: an evaluation that fails must not cost it
        stop = hooks.after_step(ctx.eng, state)
        if stop:
            state.stop_reason = state.stop_reason or "stopped by a hook"
        elif exit_interval and state.iteration % exit_interval == 0:
            state.stop_reason = f"exit_interval {exit_interval}"
        elif state.iteration == ctx.train_iters:
            state.stop_reason = ctx.end_reason
        if state.stop_reason is not None:
            exited = True
            hooks.at_exit(ctx.eng, state)  # saves the last step unless after_step just did
        hang_watch.beat("evaluation")
        if not stop and _evaluate_step(ctx, state, hooks, eval_interval):
            window = _Window()  # evaluation time is not training throughput
        if state.stop_reason is not None:
            break

    if not exited:  # the loop ran no step (a run resumed at its end)
        state.stop_reason = state.stop_reason or "train_iters reached"
        hooks.at_exit(ctx.eng, state)
    return state  # the run's summary says where and why it stopped (pretrain)
