"""The side-by-side benchmark runs end to end on a CPU with tiny sizes: every contender trains, the
table and the ratios are printed. This checks the harness, not the speed (speed goals are never tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "256",
        "--rounds", "2", "--block", "1", "--warmup", "1", "--matmul-size", "128"]


def run_compare(*extra: str) -> str:
    cmd = [sys.executable, str(REPO / "tools" / "bench" / "compare.py"), *TINY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def tokens_per_sec(out: str, name: str) -> float:
    row = re.search(rf"^{name} +([\d,]+) +([\d,]+) +([\d.]+) +([\d.]+)%", out, re.MULTILINE)
    assert row, f"no row for {name}:\n{out}"
    return float(row.group(1).replace(",", ""))


def test_all_contenders_side_by_side_with_ratios() -> None:
    out = run_compare("--contenders", "deepy,hf,nanogpt,raw")
    for name in ("deepy", "hf", "nanogpt", "raw"):
        assert tokens_per_sec(out, name) > 0
    assert re.search(r"measured fp32 matmul peak: [\d.]+ TFLOP/s", out), out
    for other in ("hf", "nanogpt", "raw"):
        ratio = re.search(rf"ratio deepy/{other}: ([\d.]+) \(median of per-round ratios", out)
        assert ratio and float(ratio.group(1)) > 0, out
    assert re.search(r"^2 rounds of 1 steps per contender", out, re.MULTILINE), out


def test_unknown_contender_is_refused() -> None:
    cmd = [sys.executable, str(REPO / "tools" / "bench" / "compare.py"), *TINY, "--contenders", "deepy,megatron"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "megatron" in proc.stderr
