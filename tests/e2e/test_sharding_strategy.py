"""``sharding_strategy: hsdp`` on 4 CPU ranks as 2 "nodes" of 2 (ZeRO-3 + DeepSpeed ZeRO++ hpZ with a
2-rank partition) trains the tiny parity model to the single-rank losses."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_parity import BASE_CONFIG, assert_close, deepy, free_port, load_golden


def test_hsdp_on_two_nodes_of_two_equals_single_rank_losses(tmp_path: Path) -> None:
    config = {**BASE_CONFIG, "num_gpus": 4, "sharding_strategy": "hsdp",
              "zero_optimization": {"zero_hpz_partition_size": 2},  # 2 ranks per "node" on this one machine
              "log_dir": str(tmp_path / "logs"), "master_port": free_port()}
    proc = deepy(config, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    resolved = json.loads(next((tmp_path / "logs").rglob("deepy_config.json")).read_text())
    assert resolved["deepspeed_config"]["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/lm_loss"] for r in rows if "train/lm_loss" in r]
    assert_close("hsdp", "train/lm_loss", losses, load_golden()["train/lm_loss"], rtol=1e-5)


def test_zero_init_trains_the_same_model(tmp_path: Path) -> None:
    """Built under deepspeed.zero.Init (fms-fsdp's low_cpu_fsdp), the weights are the same functions of
    the seed: 2 ranks of ZeRO-3 reproduce the single-rank losses."""
    config = {**BASE_CONFIG, "num_gpus": 2, "sharding_strategy": "fsdp", "zero_init": True,
              "log_dir": str(tmp_path / "logs"), "master_port": free_port()}
    proc = deepy(config, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/lm_loss"] for r in rows if "train/lm_loss" in r]
    assert_close("zero_init", "train/lm_loss", losses, load_golden()["train/lm_loss"], rtol=1e-5)
