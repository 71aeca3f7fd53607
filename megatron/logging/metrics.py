"""``<log_dir>/metrics.jsonl``: one JSON object per logged step, written by the rank that speaks.

Rows are appended and flushed at once so a crashed or killed run keeps every row it logged, and a
resumed run continues the same file. Metric names are prefixed and stable (``train/lm_loss``,
``train/lr``, ``throughput/tokens_per_sec``, ``eval/lm_loss``); tests and plots key on them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

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


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a metrics file (a log directory or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, Any]]:
    """(iteration, value) for every row that has ``key``."""
    return [(row["iteration"], row[key]) for row in rows if key in row]
