"""``zero_init`` (fms-fsdp's ``low_cpu_fsdp``): a 100M-parameter model built on 2 gloo ranks under
``deepspeed.zero.Init`` (Deepy's ``construction``) leaves each rank with half of it and a lower peak
resident memory than building it whole; one spawn per way of building, since the peak is per process.

glibc's default malloc keeps freed multi-MB blocks in the heap after its dynamic mmap threshold has
grown, so the peak would measure the allocator's retention rather than what construction needs; the
ranks fix the threshold (MALLOC_MMAP_THRESHOLD_, glibc's documented tunable) so freed layers go back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.distributed.rank_harness import finish_rank, record_checks, run_ranks

WORLD = 2


def _status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_main(rank: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from megatron.deepspeed_internals import defer_muon_kernel_compiles, skip_shared_memory_comm_op
    from megatron.model.config import GPTConfig
    from megatron.model.gpt import GPTModel
    from megatron.mpu import topology
    from megatron.engine.build import construction

    skip_shared_memory_comm_op()
    defer_muon_kernel_compiles()  # as train.py: ZeRO's Muon check without TorchInductor
    dist.init_process_group("gloo")
    topology.initialize_model_parallel(1, 1)
    zero_init = os.environ["ZERO_INIT_TEST_MODE"] == "zero_init"
    config = GPTConfig(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=32, padded_vocab_size=512)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    held: dict[str, float] = {}

    def build() -> None:
        # the peak since a reset of the high-water mark (Linux: "5" to /proc/self/clear_refs), not
        # ru_maxrss: a spawned rank (fork + exec) starts with its parent's maximum, which may already exceed the build's
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        with construction(ds_config if zero_init else None):
            model = GPTModel(config)
        held["peak_mib"] = (_status_kib("VmHWM") - before) / 1024
        params = list(model.parameters())
        held["total"] = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        held["held"] = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)

    results = record_checks({"build": build})
    results["held"] = json.dumps(held)
    finish_rank(out, rank, results)


def spawn(mode: str, out: Path) -> list[dict[str, float]]:
    from tests.e2e.test_parity import free_port

    os.environ.update(ZERO_INIT_TEST_MODE=mode, MASTER_PORT=str(free_port()), MALLOC_MMAP_THRESHOLD_="1048576")
    try:
        # new interpreters: glibc reads MALLOC_MMAP_THRESHOLD_ at a process's start
        per_rank = run_ranks(rank_main, WORLD, out, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
    for results in per_rank:
        assert results["build"] == "ok", results["build"]
    return [json.loads(results["held"]) for results in per_rank]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, float]]]:
    return {mode: spawn(mode, tmp_path_factory.mktemp(mode)) for mode in ("eager", "zero_init")}


def test_each_rank_holds_half_of_the_model(measured: dict[str, list[dict[str, float]]]) -> None:
    for rank in range(WORLD):
        eager, partitioned = measured["eager"][rank], measured["zero_init"][rank]
        assert eager["held"] == eager["total"] > 100e6
        assert partitioned["total"] == eager["total"]
        assert partitioned["held"] == pytest.approx(eager["total"] / WORLD, rel=1e-3)


def test_peak_resident_memory_is_lower_than_eager(measured: dict[str, list[dict[str, float]]]) -> None:
    model_mib = measured["eager"][0]["total"] * 4 / 2**20  # fp32 weights of the whole model
    for rank in range(WORLD):
        eager, partitioned = measured["eager"][rank]["peak_mib"], measured["zero_init"][rank]["peak_mib"]
        print(f"rank {rank}: peak RSS growth eager {eager:.0f} MiB, zero_init {partitioned:.0f} MiB "
              f"(model {model_mib:.0f} MiB)")
        # half the model plus one layer in flight, against the whole model
        assert partitioned < eager - 0.25 * model_mib, (rank, partitioned, eager, model_mib)
