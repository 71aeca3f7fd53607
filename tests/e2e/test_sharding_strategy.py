"""``sharding_strategy: hsdp`` on 4 CPU ranks as 2 "nodes" of 2 (``sharding_group_size: 2``): ZeRO-3
within each pair, the pairs replicated, gradients averaged over the replicas.

One 4-rank run trains the parity model for 10 steps and saves at step 5; its losses and gradient
norms are the single-rank golden values (rtol 1e-5). Its step-5 checkpoint holds 2 ZeRO partitions
(written by replica 0 only) and resumes both as hsdp 2x2 (DeepSpeed's own loader, every replica
reading the same files) and on 1 rank (through a universal checkpoint), each continuing the
uninterrupted curve. Memory per rank: tests/distributed/test_sharding_memory.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_parity import BASE_CONFIG, assert_close, deepy, free_port, load_golden

HSDP_2X2: dict[str, Any] = {"num_gpus": 4, "sharding_strategy": "hsdp", "sharding_group_size": 2}
SAVE_STEP = 5
RESUME_RTOL = 2e-5
"""A resume at another layout sums in another order (tests/e2e/test_resume_layout.py's bound)."""


def metrics(log_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def run(tmp: Path, name: str, **values: Any) -> tuple[Path, str]:
    """(the run's folder, its output)."""
    work = tmp / name
    work.mkdir()
    config = {**BASE_CONFIG, **values, "log_dir": str(work / "logs"), "master_port": free_port()}
    proc = deepy(config, work)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return work, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hsdp")
    # built under deepspeed.zero.Init (fms-fsdp's low_cpu_fsdp): partitioned over the shard group from the start
    return run(tmp, "first", **HSDP_2X2, zero_init=True, save=str(tmp / "ckpt"), checkpoint_factor=SAVE_STEP)[0]


def test_hsdp_on_two_nodes_of_two_equals_single_rank_losses(hsdp_run: Path) -> None:
    resolved = json.loads(next((hsdp_run / "logs").rglob("deepy_config.json")).read_text())
    assert resolved["deepspeed_config"]["zero_optimization"] == {"stage": 3}
    golden = load_golden()
    assert_close("hsdp", "train/lm_loss", metrics(hsdp_run / "logs", "train/lm_loss"), golden["train/lm_loss"],
                 rtol=1e-5)
    # clipping (max norm 1.0) acts on the same global norm: the replicas' averaged partitions agree
    # (1e-4 as in test_parity.py: a sum of squares reduced in another order)
    assert_close("hsdp", "train/grad_norm", metrics(hsdp_run / "logs", "train/grad_norm"),
                 golden["train/grad_norm"], rtol=1e-4)


def test_replica_zero_alone_writes_two_partitions(hsdp_run: Path) -> None:
    tag = hsdp_run.parent / "ckpt" / f"global_step{SAVE_STEP}"
    optim = sorted(p.name for p in tag.glob("*optim_states.pt"))
    model = sorted(p.name for p in tag.glob("*model_states.pt"))
    assert optim == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], optim
    assert model == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)], model
    layout = json.loads((tag / "deepy_meta.json").read_text())["layout"]
    assert (layout["dp"], layout["replicas"], layout["zero_stage"]) == (4, 2, 3), layout


@pytest.mark.parametrize(("name", "layout", "rtol", "converted"), [
    # the same layout (DeepSpeed's loader, no conversion), with micro-batches of 1: the replicas average
    # the partitions accumulated over 2 micro-batches
    ("hsdp_2x2", {**HSDP_2X2, "train_micro_batch_size_per_gpu": 1}, 1e-5, False),
    ("single_rank", {"num_gpus": 1}, RESUME_RTOL, True),  # 2 partitions -> a universal checkpoint -> 1 rank
])
def test_hsdp_checkpoint_resumes(hsdp_run: Path, tmp_path: Path, name: str, layout: dict[str, Any],
                                 rtol: float, converted: bool) -> None:
    work, output = run(tmp_path, name, **layout, load=str(hsdp_run.parent / "ckpt"), iteration=SAVE_STEP)
    assert ("layout changed from tp=1 pp=1 dp=4 as 2 replicas zero=3" in output) == converted, output[-3000:]
    resumed = metrics(work / "logs", "train/lm_loss")
    assert_close(f"resumed {name}", "train/lm_loss", resumed, load_golden()["train/lm_loss"][SAVE_STEP:], rtol=rtol)


def test_zero_init_trains_the_same_model(tmp_path: Path) -> None:
    """Built under deepspeed.zero.Init (fms-fsdp's low_cpu_fsdp), the weights are the same functions of
    the seed: 2 ranks of ZeRO-3 reproduce the single-rank losses."""
    work, _ = run(tmp_path, "zero_init", num_gpus=2, sharding_strategy="fsdp", zero_init=True)
    assert_close("zero_init", "train/lm_loss", metrics(work / "logs", "train/lm_loss"), load_golden()["train/lm_loss"],
                 rtol=1e-5)
