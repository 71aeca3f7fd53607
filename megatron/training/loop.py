"""The training loop: steps, evaluation, logging, stopping, and the hooks checkpointing uses.

State that must survive a restart is in :class:`TrainState`; the data position is a pure function
of ``consumed_samples`` and each evaluation's position a pure function of the iteration, so resuming
needs nothing else. Checkpointing plugs in through :class:`Hooks`: ``after_step(engine, state)`` runs
after every optimizer step (save by iteration or wall clock, preemption) and may ask the loop to stop;
``at_exit`` runs once, after the last step (it saves that step when no ``after_step`` did).

Saving comes before evaluating: at a step that is saved, the hooks run before that step's evaluations
(validation, test, ``eval_tasks``), and at the step that ends the run ``at_exit`` does too, so an
evaluation that fails never costs the checkpoint of its step. A stop asked by a hook (preemption)
skips the evaluations of that step: the time left goes to exiting cleanly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
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
from megatron.engine.build import Engine
from megatron.training import hang_watch
from megatron.training.evaluate import Evaluator, evaluation_number
from megatron.training.model_averaging import ModelAverage
from megatron.training.skip_gate import BadStepGate
from megatron.training.stragglers import StragglerWatch
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# after_step returns True to stop the loop (e.g. a preemption signal was received)
StepHook = Callable[[Engine, TrainState], Any]


@dataclass
class Hooks:
    after_step: list[StepHook] = field(default_factory=list)
    at_exit: list[StepHook] = field(default_factory=list)


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
    tasks: Callable[[], dict[str, float]] | None = None
    """lm-eval tasks (``eval_tasks``) at every evaluation: returns ``lm_eval/<task>/<metric>`` values
    (``megatron/evaluation/in_training.py``)."""
    tasks_interval: int | None = None
    """Steps between runs of ``tasks`` (``eval_tasks_interval``); None: every ``eval_interval``."""
    end_reason: str = "train_iters reached"
    """Why the run ends at ``train_iters`` (the last step: train_iters, or where max_train_epochs end)."""
    averaging: ModelAverage | None = None
    """The EMA of the weights (``ema_beta``): updated after every step, evaluated beside the weights
    (``eval/ema/...``), the weights ``tasks`` run on."""
    bad_steps: BadStepGate | None = None
    """The bad-step rule (``skip_bad_steps_window``), deciding inside each optimizer step."""
    stragglers: StragglerWatch | None = None
    """The straggler watch (``straggler_factor``): each rank's own work per step, judged at log steps."""
    schedule: BatchSchedule | None = None
    """Each step's global batch (``train_batch_size_schedule``); None: ``global_batch_size`` every step."""

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
    if ctx.bad_steps is not None:
        row["train/skipped_bad_steps"] = ctx.bad_steps.rule.skipped
    row["train/consumed_tokens"] = state.consumed_tokens
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


def evaluate_now(ctx: LoopContext, state: TrainState, evaluator: Evaluator, prefix: str) -> None:
    start = time.perf_counter()
    # validation: the k-th evaluation reads the k-th block of batches; test runs once, from the start
    number = evaluation_number(state.iteration, ctx.training.eval_interval) if prefix == "eval" else 0
    metrics = evaluator.evaluate(number)  # lm_loss (the objective's loss) and the objective's metrics
    if ctx.averaging is not None:  # Levanter evaluates both: eval/loss and eval/ema/loss
        with ctx.averaging.swapped_in():
            metrics.update({f"ema/{name}": value for name, value in evaluator.evaluate(number).items()})
    row = {"iteration": state.iteration, "consumed_samples": state.consumed_samples,
           **{f"{prefix}/{name}": value for name, value in metrics.items()},
           f"timers/{prefix}_ms": 1000.0 * (time.perf_counter() - start)}
    ctx.monitor.log(row, state.iteration)
    ctx.monitor.discard_window()  # evaluation forwards are not the next window's training time


def evaluate_tasks_now(ctx: LoopContext, state: TrainState) -> None:
    assert ctx.tasks is not None
    with ctx.averaging.swapped_in() if ctx.averaging is not None else contextlib.nullcontext():
        results = ctx.tasks()  # Levanter runs lm-eval on the average (TrainerState.eval_model)
    row = {"iteration": state.iteration, "consumed_samples": state.consumed_samples, **results}
    ctx.monitor.log(row, state.iteration)
    ctx.monitor.discard_window()


def _evaluate_step(ctx: LoopContext, state: TrainState, eval_interval: int | None) -> bool:
    """The evaluations due after this step: every ``eval_interval`` steps, and the last validation, the
    test split and the tasks after the last step. True when any ran."""
    periodic = bool(eval_interval) and state.iteration % int(eval_interval or 1) == 0
    tasks_every = ctx.tasks_interval or eval_interval
    tasks_due = bool(tasks_every) and state.iteration % int(tasks_every or 1) == 0
    last = state.iteration == ctx.train_iters
    ran = False
    if ctx.valid is not None and (periodic or last):
        evaluate_now(ctx, state, ctx.valid, "eval")
        ran = True
    if ctx.tasks is not None and (tasks_due or last):
        evaluate_tasks_now(ctx, state)
        ran = True
    if ctx.test is not None and last:
        evaluate_now(ctx, state, ctx.test, "test")
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
    watch = hang_watch.current()
    micro_batches = beating(ctx.micro_batches) if watch is not None else ctx.micro_batches
    first = True
    eval_interval = ctx.training.eval_interval
    exit_interval = ctx.training.exit_interval
    limit = ctx.training.max_consecutive_overflows
    ctx.eng.engine.train()
    window = _Window()
    exited = False
    while state.iteration < ctx.train_iters:
        lr = ctx.eng.lr_scheduler.get_last_lr()[0]
        ctx.monitor.before_step(state.iteration + 1)
        samples, tokens = ctx.step_batch(state.iteration)
        if ctx.schedule is not None and samples != ctx.eng.engine.train_batch_size():
            # the micro batch stays, DeepSpeed's accumulation steps (the objective's micro-batch count) follow
            ctx.eng.engine.set_train_batch_size(samples)
        hang_watch.beat("data", state.iteration)
        result = train_step(ctx.eng, micro_batches, ctx.device)
        state.iteration += 1
        hang_watch.beat("save", state.iteration)  # the step's hooks: checkpoint and HF saves
        if ctx.stragglers is not None:
            ctx.stragglers.end_step()
        if first and watch is not None:
            watch.first_step_done()  # torchtitan's train_timeout_seconds from here on
        first = False
        state.consumed_samples += samples
        state.consumed_tokens += tokens
        if ctx.averaging is not None:
            ctx.averaging.update()  # after every step, skipped or not (Levanter's take_step)
        if ctx.bad_steps is not None:
            state.bad_steps = ctx.bad_steps.rule.to_dict()
        log_step = ctx.monitor.is_log_step(state.iteration)
        ctx.monitor.after_step(state.iteration)
        window.add(result, lr, samples, tokens)
        _check_overflow(state, result, limit)

        if log_step:
            row = log_row(ctx, state, window, result)
            if ctx.stragglers is not None:
                row.update(ctx.stragglers.check(state.iteration))  # a collective: every rank at log steps
            ctx.monitor.log(row, state.iteration)
            window = _Window()

        # the step's checkpoint first: an evaluation that fails must not cost it
        stop = False
        for hook in hooks.after_step:
            stop = bool(hook(ctx.eng, state)) or stop
        if stop:
            state.stop_reason = state.stop_reason or "stopped by a hook"
        elif exit_interval and state.iteration % exit_interval == 0:
            state.stop_reason = f"exit_interval {exit_interval}"
        elif state.iteration == ctx.train_iters:
            state.stop_reason = ctx.end_reason
        if state.stop_reason is not None:
            exited = True
            for hook in hooks.at_exit:  # saves the last step unless after_step just did
                hook(ctx.eng, state)
        hang_watch.beat("evaluation")
        if not stop and _evaluate_step(ctx, state, eval_interval):
            window = _Window()  # evaluation time is not training throughput
        if state.stop_reason is not None:
            break

    if not exited:  # the loop ran no step (a run resumed at its end)
        state.stop_reason = state.stop_reason or "train_iters reached"
        for hook in hooks.at_exit:
            hook(ctx.eng, state)
    return state  # the run's summary says where and why it stopped (pretrain)
