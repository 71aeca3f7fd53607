"""The training loop's one handle on observability: trackers, timers, statistics, profiler, progress.

The loop calls, per step, :meth:`Monitor.before_step` and :meth:`Monitor.after_step`; at log steps
it builds its row (loss, lr, throughput), adds :meth:`Monitor.window_metrics` (``timers/*`` and the
``log_*`` statistics, the gradient noise scale) and hands it to :meth:`Monitor.log`, which fans it out to the trackers and
the console. Everything else (which tracker, which statistic, when the profiler runs) is decided
here from the logging keys (:class:`~megatron.logging.config.LoggingArgs`), so the loop stays a few lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from megatron.logging.heartbeats import restarts_so_far
from megatron.logging.noise_scale import NoiseScaleLogger
from megatron.logging.config import LoggingArgs, TrackerSettings, WandbSettings
from megatron.logging.profiling import StepProfiler
from megatron.logging.progress import TrainingProgress
from megatron.logging.stats import StatsCollector
from megatron.logging.timers import Timers
from megatron.logging.trackers import TrackerContext, Trackers, build_trackers, new_run_name, new_wandb_run_id


class Monitor:
    def __init__(self, *, config: LoggingArgs, trackers: Trackers, timers: Timers, progress: TrainingProgress,
                 train_iters: int, stats: StatsCollector | None = None, profiler: StepProfiler | None = None,
                 run_name: str | None = None, noise_scale: NoiseScaleLogger | None = None) -> None:
        self.config = config
        self.run_name = run_name
        """The run's name, the same on every rank (saved with checkpoints as ``TrainState.run_name``)."""
        self.trackers = trackers
        self.timers = timers
        self.progress = progress
        self.train_iters = train_iters
        self.stats = stats
        self.profiler = profiler
        self.noise_scale = noise_scale
        """The gradient noise scale (``log_gradient_noise_scale``), fed every step."""
        self.started: float | None = None
        """When this launch's first step began (``time.monotonic``), for the summary's wall time."""
        self.last: dict[str, Any] = {}
        """The newest logged value of every metric (the summary's losses)."""

    @property
    def wandb_run_id(self) -> str | None:
        return self.trackers.wandb_run_id

    def is_log_step(self, iteration: int) -> bool:
        return iteration % self.config.log_interval == 0 or iteration == self.train_iters

    def before_step(self, iteration: int) -> None:
        """``iteration``: the step about to run (1-based)."""
        if self.started is None:
            self.started = time.monotonic()
            self.progress.begin()
        if self.stats is not None:
            self.stats.arm(self.is_log_step(iteration))
        if self.noise_scale is not None:
            self.noise_scale.arm()
        if self.profiler is not None:
            self.profiler.before_step(iteration)

    def after_step(self, iteration: int) -> None:
        if self.profiler is not None:
            self.profiler.after_step(iteration)
        self.progress.step(iteration)

    def window_metrics(self, iterations: int) -> dict[str, float]:
        """``timers/*`` for the logging window and the statistics of the last step (every rank
        must call this at log steps: the statistics gather over the model's ranks)."""
        row = self.timers.window_metrics(iterations)
        if self.stats is not None:
            row.update(self.stats.collect())
        if self.noise_scale is not None and self.noise_scale.noise_scale is not None:
            row["train/noise_scale"] = self.noise_scale.noise_scale  # GPT-NeoX's name (logging.py:353)
        return row

    def discard_window(self) -> None:
        """Forget the timers accumulated so far (time spent on something other than training)."""
        self.timers.window_metrics(1)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if not self.last:  # this launch's first row: how many restarts (max_restarts) led to it, for the trackers
            restarts = restarts_so_far()
            row = {**row, "resilience/restarts": len(restarts)} if restarts else row
        self.trackers.log({k: v for k, v in row.items() if k != "iteration"}, step)
        self.last.update(row)
        self.progress.row({"iteration": step, **row})

    def message(self, text: str) -> None:
        self.progress.message(text)

    def elapsed(self) -> float:
        """Seconds since this launch's first step began (0 before it)."""
        return 0.0 if self.started is None else time.monotonic() - self.started

    def close(self, iteration: int, failed: bool = False) -> None:
        if self.profiler is not None:
            self.profiler.stop(iteration)
            for path in self.profiler.written:
                self.progress.message(f"profile written to {path}")
        self.progress.close()
        self.trackers.finish(failed)


def agree_on_wandb_run_id(resumed: str | None, trackers: tuple[TrackerSettings, ...]) -> str | None:
    """One W&B run id for every rank: the checkpoint's when resuming, else the configured one
    (``tracker: {id: ...}``), else rank 0's new one."""
    if not any(isinstance(t, WandbSettings) for t in trackers):
        return resumed

    chosen = next((t.run_id for t in trackers if isinstance(t, WandbSettings) and t.run_id), None)
    proposal = [resumed or chosen or (new_wandb_run_id() if not dist.is_initialized() or dist.get_rank() == 0 else None)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(proposal, src=0)
    return proposal[0]


def agree_on_run_name(resumed: str | None) -> str:
    """The run's name: the checkpoint's when resuming, else rank 0's new one, on every rank."""
    if resumed:
        return resumed

    proposal = [new_run_name() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(proposal, src=0)
    return str(proposal[0])


def build_monitor(config: LoggingArgs, *, engine: Any, rank: int, speaks: bool, start_iteration: int,
                  train_iters: int, wandb_run_id: str | None, run_config: Mapping[str, Any],
                  logger: logging.Logger, cuda: bool, wall_clock_breakdown: bool,
                  run_name: str | None = None) -> Monitor:
    """Everything the loop logs through, for this rank. ``run_name``: the resumed run's name (None:
    a new run, named here); ``wall_clock_breakdown``: the DeepSpeed config's switch of its engine timers,
    which the monitor then reads."""
    tracker_settings = config.tracker_settings()
    run_id = agree_on_wandb_run_id(wandb_run_id, tracker_settings)
    name = agree_on_run_name(run_name)
    ctx = TrackerContext(rank=rank, speaks=speaks, run_id=run_id, start_step=start_iteration, run_config=run_config,
                         run_name=name)
    trackers = build_trackers(tracker_settings, ctx, config.log_dir)
    timers = Timers(wall_clock_breakdown)
    timers.attach(engine)
    stats, profile = config.stats_settings, config.profile_settings()
    return Monitor(
        config=config,
        trackers=trackers,
        timers=timers,
        progress=TrainingProgress(total=train_iters, start=start_iteration, enabled=speaks, logger=logger),
        train_iters=train_iters,
        stats=StatsCollector(stats, engine) if stats.any else None,
        profiler=StepProfiler(profile, rank, cuda) if profile.any else None,
        run_name=name,
        noise_scale=NoiseScaleLogger(engine, config.gradient_noise_scale_n_batches,
                                     config.gradient_noise_scale_cpu_offload)
        if config.log_gradient_noise_scale else None,
    )
