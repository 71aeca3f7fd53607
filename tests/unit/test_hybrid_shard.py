"""Hybrid sharding's groups and what ``sharding_strategy: hsdp`` is refused with, before launch.

The 4-rank runs are tests/e2e/test_sharding_strategy.py (losses, checkpoints) and
tests/distributed/test_sharding_memory.py (what each rank holds).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.mpu import build_topology
from megatron.mpu.hybrid_shard import shard_and_replica_ranks
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.loading import load_config

REPO = Path(__file__).resolve().parents[2]
MODEL = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
train_iters: 2
lr: 0.001
train_micro_batch_size_per_gpu: 1
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
sharding_strategy: hsdp
"""


def test_shard_groups_are_consecutive_and_replicas_take_the_same_index() -> None:
    shards, replicas = shard_and_replica_ranks(build_topology(1, 0, 4), 2)
    assert shards == [[0, 1], [2, 3]] and replicas == [[0, 2], [1, 3]]
    shards, replicas = shard_and_replica_ranks(build_topology(1, 0, 8), 4)  # 2 nodes of 4
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]] and replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="does not divide"):
        shard_and_replica_ranks(build_topology(1, 0, 4), 3)


def resolve(tmp_path: Path, extra: str, world: int = 4, model: str = MODEL):  # type: ignore[no-untyped-def]
    (tmp_path / "run.yml").write_text(model + textwrap.dedent(extra))
    return finalize(load_config([str(tmp_path / "run.yml")]), world, device=Device(cuda=False, fp16_supported=False))


def test_shard_size_defaults_to_the_ranks_of_a_node(tmp_path: Path) -> None:
    resolved = resolve(tmp_path, "num_gpus: 4\n")
    assert resolved.args.sharding_group_size == 4  # one node: a single replica, ZeRO-3 over every rank
    assert resolved.deepspeed_config["zero_optimization"] == {"stage": 3}
    assert resolve(tmp_path, "num_gpus: 4\nsharding_group_size: 2\n").args.sharding_group_size == 2


@pytest.mark.parametrize(("extra", "says"), [
    ("sharding_group_size: 3\n", "sharding_group_size=3 ({f}:12) does not divide the data-parallel size 4"),
    ("zero_optimization: {zero_hpz_partition_size: 2}\n", "not ZeRO++ hpZ"),
    ("zero_optimization: {offload_optimizer: {device: cpu}}\n", "with ZeRO offload"),
    ("pipe_parallel_size: 1\n", "with pipe_parallel_size=1 ({f}:12): ZeRO-3 does not run under"),
    ("context_parallel_size: 2\n", "with context_parallel_size=2 ({f}:12) is not supported"),
    ("moe_num_experts: 2\n", "with moe_num_experts=2 ({f}:12) is not supported"),
])
def test_unsupported_combinations_are_refused_by_name(tmp_path: Path, extra: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, "num_gpus: 4\n" + extra)
    where = str(tmp_path / "run.yml")
    assert says.format(f=where) in info.value.message, info.value.message
    assert f"sharding_strategy='hsdp' ({where}:10)" in info.value.message


def test_shard_size_without_hsdp_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sharding_group_size=2 \(.*run.yml:12\) is read only with sharding_strategy"):
        resolve(tmp_path, "num_gpus: 4\nsharding_group_size: 2\n", model=MODEL.replace("hsdp", "fsdp"))


def test_refusal_exits_2_before_launch(tmp_path: Path) -> None:
    (tmp_path / "run.yml").write_text(MODEL + "num_gpus: 4\nsharding_group_size: 3\n")
    proc = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"),
                           str(tmp_path / "run.yml")], capture_output=True, text=True, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "sharding_group_size=3" in output and "does not divide the data-parallel size 4" in output
    assert "Traceback" not in output


def test_an_hsdp_checkpoint_is_another_layout_than_zero3_over_every_rank() -> None:
    """2 partitions (hsdp 2x2) are not the 4 that ZeRO-3 over 4 ranks reads directly: the layout records
    the replicas, so that load converts; layouts written before the field read as 1 replica."""
    from megatron.checkpointing.universal import Layout, needs_universal

    hsdp, fsdp = Layout(1, 1, 4, 3, replicas=2), Layout(1, 1, 4, 3)
    assert needs_universal(hsdp, fsdp) and needs_universal(fsdp, hsdp) and not needs_universal(hsdp, hsdp)
    assert Layout.from_dict(hsdp.to_dict()) == hsdp
    assert Layout.from_dict({"tp": 1, "pp": 1, "dp": 4, "zero_stage": 3}) == fsdp


def test_several_nodes_without_num_gpus_need_the_shard_size(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
    hostfile = f"hostfile: {tmp_path / 'hosts'}\n"
    with pytest.raises(ConfigError, match="on several nodes without num_gpus: set sharding_group_size"):
        resolve(tmp_path, hostfile)
    assert resolve(tmp_path, hostfile + "sharding_group_size: 2\n").args.sharding_group_size == 2
