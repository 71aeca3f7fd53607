"""Where a step's time goes: data, forward, backward (compute and all-reduce), optimizer, pipeline.

Deepy times data loading itself (:class:`TimedIterator` around the micro-batch iterator). Forward,
backward, gradient all-reduce, optimizer step and the pipeline's send/receive waits are timed by
DeepSpeed's engine when ``wall_clock_breakdown`` is on (its ``SynchronizedWallClockTimer``, with
CUDA events on GPUs): :class:`Timers` reads them at each log step and turns them into
``timers/<name>_ms`` metrics, milliseconds per iteration averaged over the logging window.

DeepSpeed itself prints those timers (one line per micro-step on rank 0, bypassing its logger) and
resets them as it prints. :meth:`Timers.attach` silences that printing on the engine's timer group,
so the timers accumulate over the window until :meth:`Timers.window_metrics` reads and resets them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from megatron.deepspeed_internals import collect_engine_timers

T = TypeVar("T")

# DeepSpeed timer name -> our metric name (``timers/<name>_ms``). The micro-step twins of the global
# timers (``fwd_microstep``...) measure the same spans and are left out.
ENGINE_TIMERS: dict[str, str] = {
    "fwd": "forward",
    "bwd": "backward",
    "bwd_inner": "backward_compute",
    "bwd_allreduce": "backward_allreduce",
    "step": "optimizer",
    "batch_input": "pipe_batch_input",
    "pipe_send_output": "pipe_send_output",
    "pipe_send_grad": "pipe_send_grad",
    "pipe_recv_input": "pipe_recv_input",
    "pipe_recv_grad": "pipe_recv_grad",
}


class Timers:
    """Host-side timers of our own plus the engine's timers, summed over a logging window."""

    def __init__(self, breakdown: bool) -> None:
        self.breakdown = breakdown
        self._own: dict[str, float] = {}
        self._engine_timers: Any = None

    def add(self, name: str, seconds: float) -> None:
        self._own[name] = self._own.get(name, 0.0) + seconds

    def attach(self, engine: Any) -> None:
        """Read ``engine.timers`` (DeepSpeed's timer group) at log steps instead of letting it print."""
        if not self.breakdown:
            return

        # the spans keep accumulating until we read them (and a pipeline's backward timers start once)
        self._engine_timers = collect_engine_timers(engine, _quiet_log)

    def window_metrics(self, iterations: int) -> dict[str, float]:
        """``timers/*_ms`` per iteration since the last call; resets every timer read."""
        iterations = max(iterations, 1)
        row = {f"timers/{name}_ms": 1000.0 * seconds / iterations for name, seconds in self._own.items()}
        self._own = {}
        if self._engine_timers is not None:
            known = self._engine_timers.get_timers()
            for ds_name, ours in ENGINE_TIMERS.items():
                timer = known.get(ds_name)
                if timer is None:
                    continue
                elapsed_ms = float(timer.elapsed(reset=True))
                if elapsed_ms > 0.0:
                    row[f"timers/{ours}_ms"] = elapsed_ms / iterations
            for timer in known.values():  # the rest (micro-step twins) must not grow without bound
                timer.reset()
        return row


def _quiet_log(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``SynchronizedWallClockTimer.log``: no print, no reset."""


class TimedIterator(Generic[T]):
    """Wraps an iterator; the time spent in ``next`` is added to ``timers`` as ``name``."""

    def __init__(self, inner: Iterator[T], timers: Timers, name: str = "data") -> None:
        self.inner = inner
        self.timers = timers
        self.name = name

    def __iter__(self) -> TimedIterator[T]:
        return self

    def __next__(self) -> T:
        start = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            self.timers.add(self.name, time.perf_counter() - start)

    def __getattr__(self, attr: str) -> Any:
        # the wrapped iterator's own attributes (e.g. consumed_samples) stay reachable
        return getattr(self.inner, attr)
