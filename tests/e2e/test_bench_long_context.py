"""The long-context benchmark runs its cases (cp1 and cp2 on real gloo ranks, plain and document-masked
attention) and reports them side by side; the figures themselves are docs/benchmarks.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "long_context.py"


def test_benchmark_reports_every_case_and_cp2_halves_activations(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--seq", "256", "--steps", "1", "--doc-length", "64", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["documents"], r["cp"]) for r in rows] == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(r["tokens_per_s"] > 0 and r["peak_mib"] > 0 for r in rows)
    for docs in (False, True):
        cp1, cp2 = (r["activation_mib"] for r in rows if r["documents"] == docs)
        assert 0.4 < cp2 / cp1 < 0.6, (docs, cp1, cp2)  # each rank holds half the sequence
    assert "act vs cp1" in proc.stdout
