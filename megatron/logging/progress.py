"""Progress of long operations: a tqdm bar with ETA on a terminal, plain lines otherwise.

- :class:`TrainingProgress`: the speaking rank's view of training. On a terminal, a tqdm bar over
  ``train_iters`` (ETA, s/it, the last loss) with each log row printed above it; in a log file or
  pipe, one line per ``log_interval`` with the ETA appended (a bar's carriage returns would make one
  unreadable line of a log).
- :func:`progress`: the same choice for tools (preprocessing, conversion): a tqdm bar on a terminal,
  else a line at most every ``every_s`` seconds and one at the end.
- :func:`phase`: a start line and a "done in N s" line around a step that cannot report finer
  progress (a vectorised index build, a child process).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
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
    """Console output of training on the speaking rank (silent elsewhere)."""

    def __init__(self, *, total: int, start: int, enabled: bool, logger: logging.Logger,
                 terminal: bool | None = None) -> None:
        self.total = total
        self.start_iteration = start
        self.enabled = enabled
        self.log = logger
        self.bar: Any = None
        self._redirect: Any = None
        self._rate: float | None = None  # seconds per iteration, smoothed over logging windows
        if enabled and (is_terminal() if terminal is None else terminal):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, file=sys.stdout,
                            desc="training", smoothing=0.05)
            # every line of the run's loggers (checkpoint saves, data) is printed above the bar
            self._redirect = logging_redirect_tqdm(loggers=[logger])
            self._redirect.__enter__()

    def step(self, iteration: int, loss: float | None = None) -> None:
        if self.bar is None:
            return
        self.bar.update(iteration - self.bar.n)
        if loss is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)

    def eta_seconds(self, iteration: int, ms_per_iter: float | None) -> float | None:
        if ms_per_iter is None or iteration >= self.total:
            return None
        rate = ms_per_iter / 1000.0
        # exponential smoothing: one slow window (an evaluation, a save) does not swing the ETA
        self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
        return self._rate * (self.total - iteration)

    def row(self, row: dict[str, Any]) -> None:
        """One logged row: above the bar on a terminal, a line (with ETA) otherwise."""
        if not self.enabled:
            return
        line = format_row(row, self.total)
        iteration, ms = row.get("iteration"), row.get("timers/ms_per_iter")
        if self.bar is None and isinstance(iteration, int) and isinstance(ms, (int, float)):
            eta = self.eta_seconds(iteration, float(ms))
            if eta is not None:
                line += f" | ETA {format_duration(eta)}"
        if self.bar is not None:
            self.bar.write(line)
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
        from tqdm import tqdm

        return tqdm(total=total, disable=True)
    if is_terminal(stream) if terminal is None else terminal:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, smoothing=0.1)
    return _Lines(total, desc, unit, every_s, stream)


@contextmanager
def phase(logger: logging.Logger, description: str) -> Iterator[None]:
    """``<description>...`` then ``<description>: done in N s`` (or nothing more when it fails)."""
    started = time.perf_counter()
    logger.info("%s...", description)
    yield
    logger.info("%s: done in %s", description, format_duration(time.perf_counter() - started))
