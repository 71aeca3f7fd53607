"""Each rank's progress, as a file the launcher (and the other ranks) can read: ``<run_dir>/heartbeats/rank<R>.json``.

A rank says where it is (:meth:`Heartbeat.beat`: the phase it entered and the last step it finished) in memory, at
little cost; a daemon thread writes that to its file every ``interval_s`` seconds, refreshing ``written_at`` even
when nothing changed (a finished step and the start of the next are written at once). So a file that stops being refreshed belongs to a rank that cannot run at all (stopped,
frozen in a C call that holds the GIL, its machine gone), while a rank waiting in a collective for a stuck peer
still refreshes its file, with the phase it has been waiting in since ``phase_since``.

deepy.py reads the files between launches (the furthest step any rank finished: progress, for
``max_restarts``); the hang watch reads them to name the stuck rank. Standard library only: the launcher
imports this without torch. Across hosts the files are seen where ``run_dir`` is on a shared file system
(where the run's logs and checkpoints usually are).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HEARTBEATS_DIR = "heartbeats"
HANG_EXIT_CODE = 124
"""A rank's exit code when it ended itself because the run hung (``timeout(1)``'s code for "timed out")."""

RESTARTS_ENV = "DEEPY_RESTARTS"
"""JSON list of the restarts of this deepy.py invocation before this launch (each ``{"rank", "step", "reason"}``),
set by ``megatron/launcher/restarts.py`` for the relaunched ranks; absent on a first launch."""


def restarts_so_far(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """On a rank: :data:`RESTARTS_ENV`'s restarts, oldest first (empty on a first launch)."""
    try:
        events = json.loads((os.environ if environ is None else environ).get(RESTARTS_ENV, "[]"))
    except ValueError:
        return []
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


PHASES = ("start-up", "data", "forward/backward", "save", "evaluation")
"""What a rank may be doing, in the order a step goes through them (start-up comes once)."""


@dataclass(frozen=True)
class Beat:
    rank: int
    host: str
    pid: int
    step: int
    """The last optimizer step this rank finished (the iteration count; its resumed start before the first)."""
    phase: str
    phase_since: float
    """When this rank entered ``phase`` (``time.time()``)."""
    written_at: float
    """When the file was last written (``time.time()``): a stale one means the rank cannot run."""


def beat_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / HEARTBEATS_DIR / f"rank{rank}.json"


def write_beat(run_dir: str | os.PathLike[str], beat: Beat) -> None:
    """Replace the rank's file atomically (a reader never sees half of it); never raises."""
    path = beat_path(run_dir, beat.rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(asdict(beat)), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def read_beats(run_dir: str | os.PathLike[str]) -> list[Beat]:
    """Every rank's last written beat, by rank (unreadable files are left out)."""
    beats = []
    for path in sorted((Path(run_dir) / HEARTBEATS_DIR).glob("rank*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            beats.append(Beat(int(data["rank"]), str(data["host"]), int(data["pid"]), int(data["step"]),
                              str(data["phase"]), float(data["phase_since"]), float(data["written_at"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(beats, key=lambda b: b.rank)


def steps_done(run_dir: str | os.PathLike[str]) -> int | None:
    """The furthest step any rank of the last launch finished, or None when none wrote a beat."""
    beats = read_beats(run_dir)
    return max(b.step for b in beats) if beats else None


def clear(run_dir: str | os.PathLike[str]) -> None:
    """Forget an earlier launch's beats; deepy.py calls this before it starts the ranks."""
    for path in (Path(run_dir) / HEARTBEATS_DIR).glob("*rank*.json*"):
        path.unlink(missing_ok=True)


class Heartbeat:
    """One rank's beat: :meth:`beat` in memory, a daemon thread writes it every ``interval_s`` seconds."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, step: int = 0, interval_s: float = 2.0) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.interval_s = interval_s
        self.host = socket.gethostname()
        self.step = step
        self.phase = "start-up"
        self.phase_since = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, phase: str, step: int | None = None) -> None:
        """This rank enters ``phase`` (one of :data:`PHASES`), having finished ``step`` when given. A new step is
        written at once (one small file per step: the step a failed launch reached is what decides whether a
        restart made progress); a phase alone waits for the thread."""
        with self._lock:
            # a finished step, and the start of the next one, are written at once
            new_step = (step is not None and step != self.step) or (phase == "data" and phase != self.phase)
            if step is not None:
                self.step = step
            if phase != self.phase:
                self.phase = phase
                self.phase_since = time.time()
            elif step is not None:
                self.phase_since = time.time()  # a new step in the same phase is progress too
        if new_step and self._thread is not None:
            self.write()

    def current(self) -> Beat:
        with self._lock:
            return Beat(self.rank, self.host, os.getpid(), self.step, self.phase, self.phase_since, time.time())

    def write(self) -> None:
        write_beat(self.run_dir, self.current())

    def start(self) -> Heartbeat:
        self.write()

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                self.write()

        self._thread = threading.Thread(target=run, name="deepy-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)
        self.write()
