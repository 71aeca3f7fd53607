"""The save-stall benchmark runs synchronous and background saves, to local disk and into a bucket on a moto server
of its own, and prints them side by side; the figures themselves are docs/benchmarks.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "save_stall.py"


def test_background_saves_stop_the_loop_for_less_than_synchronous_ones(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPT), "--params", "6000000", "--saves", "2", "--every", "2", "--step-seconds",
           "0.3", "--s3", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {(r["target"], r["mode"]): r for r in json.loads(out.read_text())}
    assert sorted(rows) == [("local", "async"), ("local", "sync"), ("s3", "async"), ("s3", "sync")]
    assert all(len(r["stall_s"]) == 2 and r["checkpoint_mb"] > 50 for r in rows.values())
    # into the bucket the synchronous save also waits for the upload; the background one does not
    assert rows["s3", "async"]["mean_stall_s"] < rows["s3", "sync"]["mean_stall_s"], rows
    assert "stop vs sync" in proc.stdout
