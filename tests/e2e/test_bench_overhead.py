"""The overhead benchmark runs end to end (tiny sizes: this checks the harness, not the figure)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_overhead_bench_reports_both_sides() -> None:
    cmd = [sys.executable, str(REPO / "tools" / "bench" / "train_overhead.py"), "--layers", "1", "--hidden", "32",
           "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "256", "--rounds", "2", "--block", "1",
           "--warmup", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ours = re.search(r"deepy \(DeepSpeed engine\): ([\d,]+) tokens/s", proc.stdout)
    raw = re.search(r"raw PyTorch loop: +([\d,]+) tokens/s", proc.stdout)
    ratio = re.search(r"ratio deepy/raw: ([\d.]+) best", proc.stdout)
    assert ours and raw and ratio, proc.stdout
    assert float(ratio.group(1)) > 0
