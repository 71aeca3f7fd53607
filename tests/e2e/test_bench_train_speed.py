"""The shipped-config speed benchmark runs the real ``deepy.py train.py`` path on a CPU with the tiny
config and reports its figures (the GPU runs use the same code with the big configs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "train_speed.py"


def test_tiny_config_through_deepy_reports_throughput(tmp_path: Path) -> None:
    out_json = tmp_path / "speed.json"
    cmd = [sys.executable, str(SCRIPT), "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
           "--micro-batch", "2", "--json", str(out_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # the exact overrides are printed with the command
    command = re.search(r"^command: .*deepy\.py train\.py configs/tiny\.yml (.*)$", proc.stdout, re.MULTILINE)
    assert command, proc.stdout
    for override in ("use_dummy_dataset=true", "train_micro_batch_size_per_gpu=2", "train_iters=3",
                     "log_interval=1", "pipe_parallel_size=0"):
        assert override in command.group(1).split(), command.group(1)
    assert re.search(r"tiny mb 2: [\d,]+ tokens/s, [\d.]+ TFLOP/s per device, MFU n/a", proc.stdout), proc.stdout
    result = json.loads(out_json.read_text())["results"][0]
    assert result["ok"] and result["tokens_per_sec"] > 0 and result["measured_steps"] == 2
    assert result["overrides"] == command.group(1).split()


def test_dry_run_prints_the_gpu_commands_without_running() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "gpu", "--dry-run", "--micro-batch", "4,8"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    commands = re.findall(r"^command: .*deepy\.py train\.py (configs/\S+) (.*)$", proc.stdout, re.MULTILINE)
    assert [c for c, _ in commands] == [f"configs/{name}.yml" for name in ("125M", "350M", "pythia/410M", "1-3B")
                                        for _ in (4, 8)]
    for _, overrides in commands:
        for override in ("precision=bfloat16", "zero_optimization.stage=1", "compile_layers=true",
                         "checkpoint_activations=false", "num_gpus=1"):
            assert override in overrides.split()
