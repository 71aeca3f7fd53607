"""Progress of long operations: a tqdm bar with ETA on a terminal, plain lines otherwise.

- :class:`TrainingProgress`: the speaking rank's view of training. On a terminal, a tqdm bar over
  ``train_iters`` (ETA, s/it, and the loss of the last log row: the same number as the row above it, the mean
  over its ``log_interval`` steps) with each log row printed above it; in a log file or
  pipe, one line per ``log_interval`` with the ETA appended (a bar's carriage returns would make one
  unreadable line of a log). The ETA leaves out the first step (compilation, first allocations).
- :func:`progress`: the same choice for tools (preprocessing, conversion): a tqdm bar on a terminal,
  else a line at most every ``every_s`` seconds and one at the end.
- :func:`phase`: a start line and a "done in N s" line around a step that cannot report finer
  progress (a vectorised index build, a child process).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from megatron.logging.log import format_row


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class TrainingProgress:
    """Console output of training on the speaking rank (silent elsewhere).

    The ETA is measured on the wall clock (evaluations and saves recur, so they belong in it) from the
    end of this launch's first step: a first step that compiles or allocates for a minute would
    otherwise promise minutes for seconds of work. While that first step runs, a line every
    ``heartbeat_s`` seconds says it is still running; when it took long, one line says how long and
    that the ETA leaves it out.
    """

    SLOW_FIRST_STEP_S = 20.0
    """A first step longer than this is named (compilation, first allocations, a cold disk)."""

    def __init__(self, *, total: int, start: int, enabled: bool, logger: logging.Logger,
                 terminal: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 heartbeat_s: float = 30.0) -> None:
        self.total = total
        self.start_iteration = start
        self.enabled = enabled
        self.log = logger
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.bar: Any = None
        self._redirect: Any = None
        self._began: float | None = None
        self._anchor: tuple[float, int] | None = None  # (time, iteration) the next rate is measured from
        self._rate: float | None = None  # seconds per iteration, smoothed over logging windows
        self._waiting = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if enabled and (is_terminal() if terminal is None else terminal):
            # lazy: tqdm, only when a bar is drawn on a terminal
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, file=sys.stdout,
                            desc="training", smoothing=0.05)
            # every line of the run's loggers (checkpoint saves, data) is printed above the bar
            self._redirect = logging_redirect_tqdm(loggers=[logger])
            self._redirect.__enter__()

    def begin(self) -> None:
        """The first step of this launch starts now: time it, and say so while it runs long."""
        self._began = self.clock()
        if not self.enabled or self.heartbeat_s <= 0 or self.start_iteration >= self.total:
            return
        self._heartbeat = threading.Thread(target=self._beat, name="deepy-first-step", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        waited = 0.0
        while not self._waiting.wait(self.heartbeat_s):
            waited += self.heartbeat_s
            self.message(f"step {self.start_iteration + 1} still running after {format_duration(waited)} "
                         f"(the first step compiles and allocates; later steps are faster)")

    def step(self, iteration: int) -> None:
        if self._anchor is None:
            self._first_step_done(iteration)
        if self.bar is None:
            return
        self.bar.update(iteration - self.bar.n)

    def _first_step_done(self, iteration: int) -> None:
        now = self.clock()
        self._anchor = (now, iteration)
        self._waiting.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        took = now - self._began if self._began is not None else 0.0
        if took > self.SLOW_FIRST_STEP_S:
            self.message(f"step {iteration} took {format_duration(took)} (start-up: compilation, first "
                         f"allocations); the ETA counts the steps after it")
        if self.bar is not None:
            # tqdm's rate and ETA start from here too
            self.bar.reset(total=self.total)
            self.bar.initial = self.bar.n = self.bar.last_print_n = iteration

    def eta_seconds(self, iteration: int) -> float | None:
        """Seconds left after ``iteration``, from the wall-clock rate since the last call (none before
        a step after the first one has finished)."""
        if self._anchor is None or iteration >= self.total:
            return None
        now = self.clock()
        since, at = self._anchor
        if iteration <= at:
            return None if self._rate is None else self._rate * (self.total - iteration)
        rate = (now - since) / (iteration - at)
        self._anchor = (now, iteration)
        # exponential smoothing: one slow window (an evaluation, a save) does not swing the ETA
        self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
        return self._rate * (self.total - iteration)

    def row(self, row: dict[str, Any]) -> None:
        """One logged row: above the bar on a terminal, a line (with ETA) otherwise."""
        if not self.enabled:
            return
        line = format_row(row, self.total)
        iteration = row.get("iteration")
        if self.bar is None and isinstance(iteration, int) and "train/lm_loss" in row:
            eta = self.eta_seconds(iteration)
            if eta is not None:
                line += f" | ETA {format_duration(eta)}"
        if self.bar is not None:
            self.bar.write(line)
            loss = row.get("train/lm_loss")
            if isinstance(loss, (int, float)):
                # the row's loss (a mean over the window), printed as the row prints it: one number, not the
                # last step's beside the window's (issue 42, item 18)
                self.bar.set_postfix_str(f"loss {loss:.6f}", refresh=False)
        else:
            self.log.info(line)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            self.log.info(text)

    def close(self) -> None:
        self._waiting.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Lines:
    """tqdm's update/close/set_postfix_str for a non-terminal: a line every ``every_s`` seconds."""

    def __init__(self, total: int | None, desc: str, unit: str, every_s: float, stream: TextIO) -> None:
        self.total, self.desc, self.unit, self.every_s, self.stream = total, desc, unit, every_s, stream
        self.n = 0
        self.postfix = ""
        self._t0 = self._last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self._print(now)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def _print(self, now: float, done: bool = False) -> None:
        elapsed = max(now - self._t0, 1e-9)
        rate = self.n / elapsed
        parts = [f"{self.desc}: {self.n:,}"]
        if self.total:
            parts[0] += f"/{self.total:,} {self.unit} ({100.0 * self.n / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{rate:,.1f} {self.unit}/s")
        if done:
            parts.append(f"done in {format_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"ETA {format_duration((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.n:
            self._print(time.perf_counter(), done=True)
        self.n = 0

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str = "it", *, enabled: bool = True, every_s: float = 10.0,
             stream: TextIO | None = None, terminal: bool | None = None) -> Any:
    """A tqdm bar on a terminal, else :class:`_Lines`; both take ``update(n)``, ``close()``,
    ``set_postfix_str(text)`` and work as context managers."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        # lazy: tqdm, only when a bar is drawn on a terminal
        from tqdm import tqdm

        return tqdm(total=total, disable=True)
    if is_terminal(stream) if terminal is None else terminal:
        # lazy: tqdm, only when a bar is drawn on a terminal
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, smoothing=0.1)
    return _Lines(total, desc, unit, every_s, stream)


@contextmanager
def phase(logger: logging.Logger, description: str, announce_after_s: float = 2.0) -> Iterator[None]:
    """``<description>...`` then ``<description>: done in N s`` (or nothing more when it fails), for a
    step that cannot report finer progress. A step done within ``announce_after_s`` says nothing: the
    start line comes only once it has run that long (from a timer thread), so short steps leave no
    trace on the console and long ones are never silent."""
    started = time.perf_counter()
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        logger.info("%s...", description)

    timer = threading.Timer(announce_after_s, announce)
    timer.daemon = True
    if announce_after_s <= 0:
        announce()
    else:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()
    if announced.is_set():
        logger.info("%s: done in %s", description, format_duration(time.perf_counter() - started))
