"""Hang detection on each rank (``hang_timeout``, ``startup_hang_timeout``): a rank that makes no progress ends the run
with every rank's stacks written and the stuck rank named, so that ``max_restarts`` can restart it.

Each rank beats (:func:`beat`: the phase it enters, the steps it finished) into its
:class:`~megatron.logging.heartbeats.Heartbeat`, whose thread writes ``<run_dir>/heartbeats/rank<R>.json``. A
second daemon thread here watches this rank's own beat: when one phase has lasted longer than its limit
(``startup_hang_timeout`` until the first step begins, ``hang_timeout`` after), the rank

1. appends the Python stacks of all its threads to ``<run_dir>/hangs/stacks-rank<R>.txt`` (``faulthandler``:
   written from C, whatever the main thread is blocked in);
2. names the stuck rank from the peers' heartbeat files (:func:`stuck_ranks`): one whose file is no longer
   refreshed cannot run at all (stopped, frozen holding the GIL, its machine gone); else the ranks furthest
   behind; else every rank waits in the same phase (a collective that never completes);
3. records that as its error (``megatron/logging/rank_errors.py``: deepy prints it once and ``max_restarts``
   reads it), and, when it is the launch's first error (one verdict per launch), prints it and appends an event row
   ``{"event": "hang", ...}`` to the run's metrics.jsonl;
4. exits with :data:`~megatron.logging.heartbeats.HANG_EXIT_CODE`; its launcher then ends the other ranks.

Every rank also dumps its stacks into the same file on SIGUSR2 (``kill -USR2 <pid>``: neither torch nor
DeepSpeed uses that signal). Deepy's per-node launcher (``megatron/launcher/local_ranks.py``) sends it, with
SIGCONT, to the ranks still running when one ends with the hang code, so a stopped rank's stack is written too;
under srun, mpirun or pdsh the ranks that can run write theirs.

A thread is used, not ``signal.alarm``: a rank blocked in a collective is inside a C call that a Python signal
handler would only run after, and the main thread is the one that hangs.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

from megatron.logging.heartbeats import HANG_EXIT_CODE, PHASES, Beat, Heartbeat, read_beats
from megatron.logging.metrics import append_event
from megatron.logging.rank_errors import RankErrorReport

HANGS_DIR = "hangs"
STACK_SIGNAL = signal.SIGUSR2
STALE_INTERVALS = 3
"""A heartbeat file older than this many write intervals (plus a second) belongs to a rank that cannot run."""

_current: HangWatch | None = None


def stuck_ranks(beats: list[Beat], now: float, interval_s: float) -> tuple[list[Beat], str]:
    """The ranks that hold the run up, and why: those whose heartbeat stopped; else those furthest behind
    (lowest step, then earliest phase); else all of them (every rank in the same phase)."""
    stale = [b for b in beats if now - b.written_at > STALE_INTERVALS * interval_s + 1.0]
    if stale:
        return stale, "its heartbeat stopped: the process is stopped, frozen, or its machine is gone"
    if not beats:
        return [], "no heartbeat file was found"

    def position(b: Beat) -> tuple[int, int]:
        return b.step, PHASES.index(b.phase) if b.phase in PHASES else 0

    lowest = min(position(b) for b in beats)
    behind = [b for b in beats if position(b) == lowest]
    if len(behind) < len(beats):
        return behind, "the furthest behind: the others wait for it"
    return beats, "every rank is in the same phase: a collective that never completes"


class HangWatch:
    """This rank's heartbeat and its watch (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, *, startup_limit_s: float | None,
                 limit_s: float | None, train_timeout_s: int | None = None, interval_s: float = 2.0,
                 step: int = 0) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.startup_limit_s = startup_limit_s
        self.limit_s = limit_s
        self.train_timeout_s = train_timeout_s
        self.interval_s = interval_s
        self.heartbeat = Heartbeat(run_dir, rank, step=step, interval_s=interval_s)
        self.started_steps = False
        self.timeouts_set = False
        self._stacks: IO[str] | None = None
        self._stop = threading.Event()

    @property
    def stacks_path(self) -> Path:
        return self.run_dir / HANGS_DIR / f"stacks-rank{self.rank}.txt"

    def start(self) -> HangWatch:
        self.heartbeat.start()
        try:
            self.stacks_path.parent.mkdir(parents=True, exist_ok=True)
            self._stacks = open(self.stacks_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the rank's life
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True)
        except (OSError, RuntimeError, ValueError):
            self._stacks = None
        if self.startup_limit_s is not None or self.limit_s is not None:
            threading.Thread(target=self._watch, name="deepy-hang-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.heartbeat.stop()

    def _watch(self) -> None:
        poll = min(1.0, self.interval_s)
        while not self._stop.wait(poll):
            now = self.heartbeat.current()
            limit = self.startup_limit_s if now.phase == "start-up" else self.limit_s
            if limit is not None and time.time() - now.phase_since > limit:
                self._hung(now, limit)

    def _hung(self, own: Beat, limit: float) -> None:
        """Write this rank's stacks, name the stuck rank, record it, leave with the hang code."""
        if self._stacks is not None:
            self._stacks.write(f"--- rank {self.rank} (pid {os.getpid()}): no progress for {limit:g}s in {own.phase} "
                               f"after step {own.step}, {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            self._stacks.flush()
            faulthandler.dump_traceback(file=self._stacks, all_threads=True)
            self._stacks.flush()
        # a peer that stopped just now still has a fresh file: give it the time to go stale before judging
        deadline = time.time() + STALE_INTERVALS * self.interval_s + 1.5
        while True:
            now = time.time()
            beats = [*(b for b in read_beats(self.run_dir) if b.rank != self.rank), self.heartbeat.current()]
            stuck, why = stuck_ranks(beats, now, self.interval_s)
            if why.startswith("its heartbeat stopped") or now >= deadline:
                break
            time.sleep(0.5)
        if len(stuck) == 1:
            b = stuck[0]
            who = (f"rank {b.rank} (host {b.host}, pid {b.pid}) made no progress for {now - b.phase_since:.0f}s in "
                   f"phase {b.phase} after step {b.step} ({why})")
        else:
            who = (f"ranks {', '.join(str(b.rank) for b in stuck)} made no progress in phase "
                   f"{', '.join(sorted({b.phase for b in stuck}))} ({why})")
        message = (f"deepy: hang: {who}; rank {self.rank} saw it after {limit:g}s in {own.phase} "
                   f"(hang_timeout); every rank's stacks: {self.run_dir / HANGS_DIR}/")
        if not RankErrorReport(self.run_dir, self.rank)(message, ""):
            # another rank's error came first (its own verdict on this hang, or what caused it): one verdict per
            # launch; a stopped rank continued for its stacks must not judge the peers that already ended
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)
        print(message, file=sys.stderr, flush=True)
        row = {"event": "hang", "rank": stuck[0].rank if len(stuck) == 1 else None,
               "ranks": [b.rank for b in stuck], "step": own.step, "phase": stuck[0].phase if stuck else own.phase,
               "reason": who, "detected_by": self.rank, "time": now}
        append_event(self.run_dir, row)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def first_step_done(self) -> None:
        """torchtitan's switch to ``train_timeout_seconds`` after a launch's first step (every rank calls it)."""
        if self.timeouts_set or self.train_timeout_s is None:
            return
        self.timeouts_set = True
        # lazy: torch; train.py starts the watch before importing it
        from megatron.torch_internals import set_collective_timeouts

        set_collective_timeouts(timedelta(seconds=self.train_timeout_s), barrier_first=True)


def start(run_dir: str | os.PathLike[str], rank: int, **settings: object) -> HangWatch:
    """Start this rank's watch (its beats go through :func:`beat` from then on)."""
    global _current
    _current = HangWatch(run_dir, rank, **settings).start()  # type: ignore[arg-type]
    return _current


def current() -> HangWatch | None:
    return _current


def beat(phase: str, step: int | None = None) -> None:
    """This rank enters ``phase`` (having finished ``step``); nothing when no watch runs (tests, tools)."""
    if _current is not None:
        _current.heartbeat.beat(phase, step)
