"""One copy of each error of a run, however many ranks hit it.

In a data-parallel run every rank usually fails the same way at the same moment (a corrupt
checkpoint, a data error): printing on every rank repeats the message N times. Like torchrun's error
files (``TORCHELASTIC_ERROR_FILE``), each failing rank records its error in the run directory,
``<run_dir>/errors/rank<R>.json``, and the first one to fail prints it (the claim is an exclusive
file create, ``errors/first``, so exactly one rank wins even across hosts on a shared file system).
When the launch has ended, deepy.py reads the records and adds one line: which ranks failed the same
way, and each *different* error once (another rank's own message, or the consequence of the first
failure, such as a peer that lost its connection).

A rank that cannot write the directory prints its error itself: an error is never lost.
Standard library only: deepy.py reads the records after the launch without importing torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ERRORS_DIR = "errors"
FIRST = "first"
"""Created (exclusively) by the rank that prints: its content is that rank."""


@dataclass(frozen=True)
class RankError:
    rank: int
    message: str
    """One line: ``deepy: checkpoint error: ...`` or ``RuntimeError: ...``."""
    details: str
    """The traceback, when there is one to show (unexpected errors, or ``--debug``)."""


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
            record = {"rank": self.rank, "message": message, "details": details}
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
    """The recorded errors of a run (by rank) and the rank that printed its error, if any."""
    directory = Path(run_dir) / ERRORS_DIR
    errors = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            errors.append(RankError(int(data["rank"]), str(data["message"]), str(data.get("details") or "")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        printed: int | None = int((directory / FIRST).read_text().strip())
    except (OSError, ValueError):
        printed = None
    return sorted(errors, key=lambda e: e.rank), printed


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def summary(run_dir: str | os.PathLike[str]) -> list[str]:
    """What deepy.py adds after a failed launch: the ranks that failed with the printed error, and every
    other error once (with the ranks that had it). Empty when no rank recorded an error."""
    errors, printed = read_errors(run_dir)
    if not errors:
        return []
    first = next((e for e in errors if e.rank == printed), None)
    groups: dict[str, list[RankError]] = {}
    for error in errors:
        groups.setdefault(error.message, []).append(error)
    lines = []
    if first is not None:
        lines.append(f"deepy: {_ranks([e.rank for e in groups[first.message]])} failed with the error above")
    for message, group in groups.items():
        if first is not None and message == first.message:
            continue
        lines.append(f"deepy: {'also on' if first is not None else 'on'} {_ranks([e.rank for e in group])}: {message}")
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
    for path in [*directory.glob("rank*.json"), directory / FIRST]:
        path.unlink(missing_ok=True)
