"""One copy of each error of a run, however many ranks hit it.

In a data-parallel run every rank usually fails the same way at the same moment (a corrupt
checkpoint, a data error): printing on every rank repeats the message N times. Like torchrun's error
files (``TORCHELASTIC_ERROR_FILE``), each failing rank records its error in the run directory,
``<run_dir>/errors/rank<R>.json``, and the first one to fail prints it (the claim is an exclusive
file create, ``errors/first``, so exactly one rank wins even across hosts on a shared file system).
When the launch has ended, deepy.py reads the records and adds one line: which ranks failed the same
way, and each *different* error once (another rank's own message, or the consequence of the first
failure, such as a peer that lost its connection).

A rank that dies without a word (``kill -9``, the kernel's out-of-memory killer, a segfault) records
nothing; deepy's per-node launcher (``local_ranks.py``) records it for it, ``errors/exit-rank<R>.json``:
its rank, host, pid, exit status, and the last moment it was seen running. The cause of a failed run is
the event that came first: a death counts from that last moment (the launcher looks every 50 ms, so a
rank killed first is named before the peers whose collectives it broke, whose errors come later), an
error from when it was recorded. The others' errors are said after it, as its consequences.

A rank that cannot write the directory prints its error itself: an error is never lost.
Standard library only: deepy.py reads the records after the launch without importing torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ERRORS_DIR = "errors"
FIRST = "first"
"""Created (exclusively) by the rank that prints: its content is that rank."""
EXIT_PREFIX = "exit-rank"
"""``errors/exit-rank<R>.json``: a rank that ended without recording an error, as its launcher saw it."""


@dataclass(frozen=True)
class RankError:
    rank: int
    message: str
    """One line: ``deepy: checkpoint error: ...`` or ``RuntimeError: ...``."""
    details: str
    """The traceback, when there is one to show (unexpected errors, or ``--debug``)."""
    host: str = ""
    at: float = 0.0
    """When it was recorded (``time.time()``); 0 for a record without one (written by an older Deepy)."""


@dataclass(frozen=True)
class RankExit:
    """A rank that ended with a failure and recorded no error (killed by a signal, or an exit code alone)."""

    rank: int
    host: str
    pid: int
    returncode: int
    """As ``Popen`` reports it: negative for a signal."""
    alive_at: float
    """The last moment its launcher saw it running: it ended after this."""

    @property
    def how(self) -> str:
        """``killed (out of memory?) by signal 9 (SIGKILL)``, ``killed by signal 11 (SIGSEGV)``, or its exit code."""
        if self.returncode >= 0:
            return f"exited with code {self.returncode} without reporting an error"
        number = -self.returncode
        try:
            name = f" ({signal.Signals(number).name})"
        except ValueError:
            name = ""
        # SIGKILL is what the kernel's out-of-memory killer sends (and a cgroup's memory limit)
        oom = " (out of memory?)" if number == signal.SIGKILL else ""
        return f"killed{oom} by signal {number}{name}"


def record_exit(run_dir: str | os.PathLike[str], rank: int, pid: int, returncode: int, alive_at: float) -> None:
    """What a per-node launcher writes for a rank that failed without a record of its own; it also claims
    :data:`FIRST` when no rank has printed yet, so that the peers' consequent errors are not printed
    as if they were the cause. Never raises: a launcher that cannot write has printed its line anyway."""
    directory = Path(run_dir) / ERRORS_DIR
    record = {"rank": rank, "host": socket.gethostname(), "pid": pid, "returncode": returncode,
              "alive_at": alive_at}  # fmt: skip
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{EXIT_PREFIX}{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        fd = os.open(directory / FIRST, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as handle:
        handle.write(str(rank))


class RankErrorReport:
    """The ``report`` hook of :func:`megatron.errors.run_guarded` on one rank."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.directory = Path(run_dir) / ERRORS_DIR
        self.rank = rank
        self.started = time.time()
        """A claim older than this rank is an earlier launch's (deepy.py clears the directory before it starts
        the ranks, except where srun/mpirun start one deepy.py per rank)."""

    def __call__(self, message: str, details: str) -> bool:
        """Record the error; True when this rank should print it (it failed first, or cannot record)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            record = {"rank": self.rank, "message": message, "details": details, "host": socket.gethostname(),
                      "at": time.time()}
            (self.directory / f"rank{self.rank}.json").write_text(json.dumps(record), encoding="utf-8")
        except OSError:
            return True
        first = self.directory / FIRST
        try:
            fd = os.open(first, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                stale = first.stat().st_mtime < self.started - 1.0
            except OSError:
                stale = True
            if stale:  # left by an earlier launch of this run: this launch's first failure is ours
                first.write_text(str(self.rank))
            return stale
        except OSError:
            return True
        with os.fdopen(fd, "w") as handle:
            handle.write(str(self.rank))
        return True


def for_worker(argv: list[str], rank_of: Callable[[], int | None]) -> RankErrorReport | None:
    """The report of a worker started with ``--deepy_config <run_dir>/deepy_config.json``; None when the
    command line names no resolved config (the errors are then printed as they happen)."""
    path = next((b for a, b in zip(argv, argv[1:]) if a == "--deepy_config"), None)
    path = path or next((a.split("=", 1)[1] for a in argv if a.startswith("--deepy_config=")), None)
    rank = rank_of()
    if not path or rank is None:
        return None
    return RankErrorReport(Path(path).parent, rank)


def read_errors(run_dir: str | os.PathLike[str]) -> tuple[list[RankError], int | None]:
    """The recorded errors of a run (by rank) and the rank that printed its error, if any (or that its
    launcher claimed the print for, when it ended without a word: see :func:`record_exit`)."""
    directory = Path(run_dir) / ERRORS_DIR
    errors = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            errors.append(RankError(int(data["rank"]), str(data["message"]), str(data.get("details") or ""),
                                    str(data.get("host") or ""), float(data.get("at") or 0.0)))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        printed: int | None = int((directory / FIRST).read_text().strip())
    except (OSError, ValueError):
        printed = None
    return sorted(errors, key=lambda e: e.rank), printed


def read_exits(run_dir: str | os.PathLike[str]) -> list[RankExit]:
    """The ranks that ended without recording an error, as their launcher recorded them."""
    exits = []
    for path in sorted((Path(run_dir) / ERRORS_DIR).glob(f"{EXIT_PREFIX}*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            exits.append(RankExit(int(data["rank"]), str(data.get("host") or ""), int(data["pid"]),
                                  int(data["returncode"]), float(data["alive_at"])))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(exits, key=lambda e: (e.alive_at, e.rank))


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def _hosts(errors: list[RankError]) -> str:
    hosts = sorted({e.host for e in errors if e.host})
    return f" (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})" if hosts else ""


def _exit_line(ended: RankExit, lead: str, memory: str | None, cause: bool = False) -> str:
    """``deepy: rank 0 on host h1 (pid 4242) failed first: killed (out of memory?) by signal 9 (SIGKILL); ...``"""
    where = f" on host {ended.host}" if ended.host else ""
    oom = f"; {memory}" if memory and ended.returncode == -signal.SIGKILL else ""
    role = " failed first:" if cause else ""
    return f"deepy: {lead}rank {ended.rank}{where} (pid {ended.pid}){role} {ended.how}{oom}"


def summary(run_dir: str | os.PathLike[str], memory: str | None = None) -> list[str]:
    """What deepy.py adds after a failed launch: the rank that failed first (the cause) with its host, and
    every other error once (with the ranks that had it), as what followed. Empty when no rank recorded
    anything. ``memory``: the launch's memory estimate, said beside a rank killed by SIGKILL (what the
    kernel's out-of-memory killer sends)."""
    errors, printed = read_errors(run_dir)
    reported = {e.rank for e in errors}
    exits = [e for e in read_exits(run_dir) if e.rank not in reported]  # an error says more than its exit code
    if not errors and not exits:
        return []
    first = next((e for e in errors if e.rank == printed), None)
    earliest = min((e.at for e in errors if e.at), default=None)
    # a rank that died before any error was recorded is the cause: the errors are its peers' broken collectives
    dead_first = exits and (earliest is None or exits[0].alive_at < earliest)
    groups: dict[str, list[RankError]] = {}
    for error in errors:
        groups.setdefault(error.message, []).append(error)
    lines = []
    if dead_first:
        lines.append(_exit_line(exits[0], "", memory, cause=True))
        for ended in exits[1:]:
            lines.append(_exit_line(ended, "then ", memory))
        for message, group in groups.items():
            above = " (printed above)" if printed in {e.rank for e in group} else ""
            lines.append(f"deepy: then, most likely as a consequence, on {_ranks([e.rank for e in group])}"
                         f"{_hosts(group)}: {message}{above}")
    else:
        if first is not None:
            same = groups[first.message]
            lines.append(f"deepy: {_ranks([e.rank for e in same])} failed with the error above{_hosts(same)}")
        for message, group in groups.items():
            if first is not None and message == first.message:
                continue
            lines.append(f"deepy: {'also on' if first is not None else 'on'} {_ranks([e.rank for e in group])}"
                         f"{_hosts(group)}: {message}")
        lines += [_exit_line(ended, "also: ", memory) for ended in exits]
    if any(e.details for e in errors):
        lines.append(f"deepy: each rank's error and traceback: {Path(run_dir) / ERRORS_DIR}/rank<N>.json")
    return lines


RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
"""Where a rank finds its global rank before (and after) joining the job: DeepSpeed's launchers and
ours set RANK; srun and mpirun set their own, which the rank maps to RANK when it joins."""


def current_rank() -> int | None:
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def clear(run_dir: str | os.PathLike[str]) -> None:
    """Forget an earlier launch's errors (a resumed run reuses its directory); deepy.py calls this before
    it starts the ranks."""
    directory = Path(run_dir) / ERRORS_DIR
    for path in [*directory.glob("rank*.json"), *directory.glob(f"{EXIT_PREFIX}*.json"), directory / FIRST]:
        path.unlink(missing_ok=True)
