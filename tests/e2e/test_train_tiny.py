"""End to end: ``deepy.py train.py configs/tiny.yml configs/local_setup.yml`` on the built-in pydocs
corpus, 2 CPU ranks, a shortened schedule; the loss must fall and metrics.jsonl must hold the
agreed rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

REPO = Path(__file__).resolve().parents[2]
ITERS = 60


@pytest.mark.slow
def test_tiny_config_trains_on_pydocs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # local_setup.yml's relative paths (data/pydocs, logs, checkpoints) resolve inside tmp_path
    built = subprocess.run([sys.executable, str(REPO / "prepare_data.py"), "-d", str(tmp_path / "data")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    overrides = [f"train_iters={ITERS}", f"lr_decay_iters={ITERS}", "eval_interval=30", "checkpoint_factor=30",
                 "log_interval=10", f"master_port={free_port()}"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "deepy.py"), str(REPO / "train.py"), str(REPO / "configs" / "tiny.yml"),
         str(REPO / "configs" / "local_setup.yml"), *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "rank=1 tp=0 pp=0 dp=1 world=2" in output  # both ranks started and reported coordinates

    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/lm_loss" in r]
    evals = [r for r in rows if "eval/lm_loss" in r]
    assert [r["iteration"] for r in train] == list(range(10, ITERS + 1, 10))
    for key in ("consumed_samples", "train/lr", "train/grad_norm", "throughput/tokens_per_sec"):
        assert all(key in r for r in train), key
    assert train[-1]["consumed_samples"] == ITERS * 8  # global batch 8 = 4 per rank x 2 ranks
    assert [r["iteration"] for r in evals] == [30, 60]

    first, last = train[0]["train/lm_loss"], train[-1]["train/lm_loss"]
    # a uniform guess over the 8192-token vocabulary costs ln(8192) = 9.0; the model must learn
    assert last < first - 1.0, [r["train/lm_loss"] for r in train]
    assert evals[-1]["eval/lm_loss"] < evals[0]["eval/lm_loss"]
    assert any(r.get("test/lm_loss") is not None for r in rows)
