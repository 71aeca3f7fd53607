"""Reading ``metrics.jsonl`` back in tests: the rows a run logged and one metric's series.

Training only writes the file (``megatron.logging.metrics``) and ``tools/plot_metrics.py`` reads runs its
own way, so these readers live with the tests that use them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron.logging.metrics import METRICS_FILE


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a metrics file (the file itself, or a log directory: its link to the newest run's file)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, Any]]:
    """(iteration, value) for every row that has ``key``."""
    return [(row["iteration"], row[key]) for row in rows if key in row]
