"""``metrics.jsonl``: one JSON object per logged step, written by the rank that speaks.

One run, one file: a training run writes ``<log_dir>/<run name>/metrics.jsonl``, where the name is
given at the run's first launch and carried by its checkpoints (``TrainState.run_name``). A resumed
run continues its own file, first dropping the rows its previous launch logged after the checkpoint
it resumes from (those steps are trained and logged again, so the file never holds two values for
one step); a different run sharing ``log_dir`` gets a file of its own. ``<log_dir>/metrics.jsonl``
is a symbolic link to the newest run's file, so ``tail -f logs/metrics.jsonl`` follows what runs now.

Rows are appended and flushed at once so a crashed or killed run keeps every row it logged. Metric
names are prefixed and stable (``train/lm_loss``, ``train/lr``, ``throughput/tokens_per_sec``,
``eval/lm_loss``); tests and plots key on them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from megatron.atomic_files import atomic_path

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    """Plain JSON: tensors and numpy scalars become floats, NaN/inf become null (valid JSON)."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends rows to a jsonl file; a disabled writer (non-speaking rank) does nothing."""

    def __init__(self, log_dir: str | os.PathLike[str] | None, enabled: bool = True) -> None:
        self.enabled = enabled and log_dir is not None
        self.path: Path | None = Path(log_dir) / METRICS_FILE if log_dir is not None else None
        self._file: TextIO | None = None
        if self.enabled and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    @classmethod
    def for_run(cls, log_dir: str | os.PathLike[str], run_name: str, resume_from: int = 0,
                enabled: bool = True) -> MetricsWriter:
        """The writer of run ``run_name``'s own file, continued after step ``resume_from`` (0: a new run)."""
        run_dir = Path(log_dir) / run_name
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            truncate_after(run_dir / METRICS_FILE, resume_from)
            point_newest_run(Path(log_dir), run_name)
        return cls(run_dir, enabled)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({k: _jsonable(v) for k, v in row.items()}, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_event(run_dir: str | os.PathLike[str], row: dict[str, Any]) -> None:
    """One event row (``{"event": "restart"|"hang"|"straggler", ...}``, no ``iteration``: a resumed run's
    :func:`truncate_after` keeps it) at the end of the run's metrics.jsonl, in one write in append mode, from any
    process (deepy.py between launches, a rank beside the speaking rank's writer); never raises."""
    try:
        path = Path(run_dir) / METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
    except OSError:
        pass


def truncate_after(path: Path, step: int) -> int:
    """Drop the rows of ``path`` logged after ``step``, and a torn last line left by a killed run
    (the next row would be glued to it), atomically; returns how many lines were dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] = lines[-1] + "\n" if _parses(lines[-1]) else ""
    kept = [line for line in lines if line and not _after(line, step)]
    if len(kept) != len(lines):
        with atomic_path(path) as tmp:
            tmp.write_text("".join(kept), encoding="utf-8")
    return len(lines) - len(kept)


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _after(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False  # not a row: not ours to judge, keep it
    return isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] > step


def point_newest_run(log_dir: Path, run_name: str) -> None:
    """Make ``<log_dir>/metrics.jsonl`` a relative link to ``<run_name>/metrics.jsonl``.

    A regular file there (written before metrics lived per run) is left alone: it is the only
    copy of an older run's rows.
    """
    link = log_dir / METRICS_FILE
    if link.exists() and not link.is_symlink():
        return
    tmp = log_dir / f".{METRICS_FILE}.{os.getpid()}.link"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(Path(run_name) / METRICS_FILE)
    os.replace(tmp, link)  # atomic: a reader sees the old run's file or the new one


def run_files(path: str | os.PathLike[str]) -> list[Path]:
    """The metrics files under ``path``: the file itself, every run's file in a log directory
    (oldest name first: names start with the launch time), or a log directory's single file."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    runs = sorted(p / METRICS_FILE for p in path.iterdir() if p.is_dir() and (p / METRICS_FILE).is_file())
    if runs:
        return runs
    return [path / METRICS_FILE]
