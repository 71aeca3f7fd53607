"""Stragglers (``straggler_factor``, ``straggler_window``): a rank whose own work per step is persistently slower
than the others' is named on the console and in the metrics; nothing stops.

Every rank of a synchronous step takes the same wall time: the fast ones wait for the slow one in the gradient
all-reduce. So each rank times only the work it does without waiting for its peers (:data:`LOCAL`): how long it
waits for its step's micro-batches (before the step's first collective) and, outside DeepSpeed's pipeline engine
(``pipe_parallel_size: 0``), its forward passes; the pipeline engine interleaves forwards with sends and receives,
so with it only the data wait is timed. With tensor,
pipeline or context parallelism, or ZeRO-3 (which gathers parameters in the forward), the forward holds
collectives too and a slow rank makes its group's forwards slow with it: there the measure isolates a slow
data-parallel replica, not one rank of it. Host time: on a GPU, kernels run asynchronously, so a slow device shows
where the host waits for it.

At log steps every rank hands in the mean of its last ``straggler_window`` steps (one ``all_gather``); a rank
above ``straggler_factor`` x the median of all ranks' means is a straggler: rank 0 names it on the console (at
most once per window), the row gets ``straggler/max_ratio``, ``straggler/slowest_rank`` and ``straggler/count``,
and an event row ``{"event": "straggler", ...}`` goes to metrics.jsonl.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.logging.metrics import append_event


class StragglerArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): naming a rank that is persistently slower than the
    others."""

    straggler_factor: float | None = Field(1.5, gt=1.0)
    """A rank whose own work per step (data wait and forward passes, averaged over `straggler_window` steps) takes
    more than this many times the median of all ranks' is named on the console and in the metrics
    (`straggler/*`, an event row in metrics.jsonl); nothing stops. null: off."""

    straggler_window: int = Field(20, ge=1)
    """Steps each rank's time is averaged over before `straggler_factor` judges it."""


class LocalClock:
    """Seconds of this rank's own work in the current step (:func:`timed` adds to it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.enabled = False

    def add(self, seconds: float) -> None:
        self.seconds += seconds

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


LOCAL = LocalClock()


def timed(fn: Callable[[], Any]) -> Any:
    """``fn()``, its wall time added to :data:`LOCAL` when the straggler watch runs."""
    if not LOCAL.enabled:
        return fn()
    start = time.perf_counter()
    try:
        return fn()
    finally:
        LOCAL.add(time.perf_counter() - start)


MIN_EXCESS_S = 0.005
"""A rank must also be this much slower than the median: on a tiny CPU model a step's own work is a millisecond or
two, where scheduling jitter alone makes ratios of 3x."""


def stragglers(means: list[float], factor: float) -> tuple[list[tuple[int, float]], float]:
    """(rank, ratio to the median) of every rank above ``factor`` x the median of ``means`` (and at least
    :data:`MIN_EXCESS_S` above it), slowest first; and the median."""
    median = statistics.median(means)
    if median <= 0:
        return [], median
    slow = [(rank, mean / median) for rank, mean in enumerate(means)
            if mean > factor * median and mean - median >= MIN_EXCESS_S]
    return sorted(slow, key=lambda item: -item[1]), median


class StragglerWatch:
    """This rank's window of local step times, judged with the others' at log steps."""

    def __init__(self, factor: float, window: int, rank: int, metrics_dir: str | Path | None,
                 say: Callable[[str], None]) -> None:  # fmt: skip
        self.factor = factor
        self.window = window
        self.rank = rank
        self.metrics_dir = Path(metrics_dir) if metrics_dir is not None else None
        self.say = say
        self.times: deque[float] = deque(maxlen=window)
        self.named_at: dict[int, int] = {}
        LOCAL.enabled = True

    def end_step(self) -> None:
        self.times.append(LOCAL.take())

    def check(self, step: int) -> dict[str, float]:
        """Every rank calls this at a log step (a collective); the row's ``straggler/*`` metrics, once a window is
        full."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        import torch.distributed as dist

        if len(self.times) < self.window or not dist.is_initialized() or dist.get_world_size() < 2:
            return {}
        mine = (sum(self.times) / len(self.times), socket.gethostname())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        means = [float(m) for m, _ in gathered]
        slow, median = stragglers(means, self.factor)
        slowest = max(range(len(means)), key=lambda r: means[r])
        row = {"straggler/max_ratio": means[slowest] / median if median > 0 else 1.0,
               "straggler/slowest_rank": float(slowest), "straggler/count": float(len(slow))}
        if self.rank == 0:
            for rank, ratio in slow:
                if step - self.named_at.get(rank, -self.window) < self.window:
                    continue
                self.named_at[rank] = step
                reason = (f"rank {rank} (host {gathered[rank][1]}) took {ratio:.1f}x the median local step time "
                          f"({1000 * means[rank]:.0f} ms vs {1000 * median:.0f} ms) over the last {self.window} steps")
                self.say(f"deepy: straggler: {reason}")
                self._event({"event": "straggler", "rank": rank, "step": step, "ratio": ratio, "reason": reason,
                             "time": time.time()})
        return row

    def _event(self, row: dict[str, Any]) -> None:
        if self.metrics_dir is not None:
            append_event(self.metrics_dir, row)
