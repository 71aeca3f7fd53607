"""``deepy-gpu-check --smoke`` on the CPU: the console script runs its CPU parts, each in a process of
its own under its cap, and writes the JSON and the table docs/benchmarks.md keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_runs_on_the_cpu_and_writes_json_and_a_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check.cli", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["smoke"] is True and results["commit"] and results["device"].startswith("CPU")
    env, attention = results["checks"]["environment"], results["checks"]["attention"]
    assert env["status"] == attention["status"] == "ok"
    assert env["torch"] and env["deepspeed"] and env["compile_toolchain_problems"] == []
    # every variant ran through Deepy's attention, and the profiler named the SDPA implementation
    variants = {k: v for k, v in attention.items() if isinstance(v, dict)}
    assert set(variants) == {"causal", "gqa + window < seq", "alibi", "packed documents"}
    assert all(v["kernel"] != "none" for v in variants.values())
    assert variants["alibi"]["kernel"] == "math"  # a float bias: the CPU's flash kernel does not take it
    table = (tmp_path / "table.md").read_text()
    assert "| environment | ok |" in table and "| attention | ok |" in table and "date: " in table
