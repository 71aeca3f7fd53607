"""What each rank holds under each ``sharding_strategy``, read from DeepSpeed's own state on 4 gloo
ranks (one spawn, in-process), against the parameter count of the model itself (counted before
DeepSpeed touches it). The DeepSpeed config is the one Deepy derives from the key, and hsdp goes
through Deepy's engine pieces (``deepspeed_mpu``, ``engine/hybrid_shard.py``) as train.py does.

- fsdp (ZeRO-3 over 4): the parameter shard (``ds_tensor``), the fp32 master partition, Adam's two
  moments and the gradient partition are each 1/4 of the model;
- hsdp as 2 "nodes" of 2 (``sharding_group_size: 2``): each of them is 1/2 of the model, and after
  a step on different data per rank the two replicas of each partition hold the same values;
- ddp (stage 0): every rank holds the whole model.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.rank_harness import finish_rank, join_data_parallel_ranks, record_checks, run_ranks

WORLD = 4
STRATEGIES = ("fsdp", "hsdp", "ddp")
STATES = ("params", "master", "exp_avg", "exp_avg_sq", "grads")


def deepy_config(strategy: str) -> tuple[dict, int | None]:
    """(DeepSpeed's zero_optimization block, sharding_group_size) as Deepy derives them."""
    from megatron.config_rules import Device
    from megatron.neox_arguments import config_from_mapping, finalize

    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=1, lr=1e-3,
                  train_micro_batch_size_per_gpu=1, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                  sharding_strategy=strategy, num_gpus=WORLD)
    if strategy == "hsdp":
        values["sharding_group_size"] = 2
    resolved = finalize(config_from_mapping(values), WORLD, device=Device(cuda=False, fp16_supported=False))
    return resolved.deepspeed_config["zero_optimization"], resolved.args.sharding_group_size


def rank_main(rank: int, out: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron.mpu import hybrid_shard
    from megatron.engine import hybrid_shard as hybrid_engine
    from megatron.engine.build import deepspeed_mpu

    join_data_parallel_ranks(rank, WORLD, "SHARDING_TEST_PORT")
    held: dict[str, dict[str, float]] = {}
    after_step: dict[str, list[float]] = {}

    def measure(strategy: str) -> None:
        zero_block, shard = deepy_config(strategy)
        hybrid_shard.initialize_hybrid_shard(shard)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        total = sum(p.numel() for p in model.parameters())  # the reference: the model, not DeepSpeed
        config = hybrid_engine.deepspeed_config({
            "train_batch_size": WORLD, "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_block,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10**6})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                          mpu=deepspeed_mpu())
        hybrid_engine.install(engine)
        torch.manual_seed(100 + rank)  # every rank reads different data
        engine.backward(engine(torch.randn(1, 64)).pow(2).mean())
        engine.step()  # one step, so the optimizer states exist
        optimizer = engine.optimizer
        params = list(engine.module.parameters())
        states = (optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).state
        counts = {
            "params": sum(p.ds_tensor.numel() for p in params) if strategy != "ddp" else total,
            "master": (sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat) if strategy != "ddp"
                       else sum(p.numel() for p in params)),
            "exp_avg": sum(s["exp_avg"].numel() for s in states.values()),
            "exp_avg_sq": sum(s["exp_avg_sq"].numel() for s in states.values()),
            "grads": optimizer.grad_partitions_flat_buffer.numel() if strategy != "ddp" else total,
        }
        held[strategy] = {name: count / total for name, count in counts.items()}
        if strategy != "ddp":
            after_step[strategy] = [float(t) for p in params for t in p.ds_tensor.detach().flatten()[:8]]
        engine.destroy()

    results = record_checks({strategy: (lambda s=strategy: measure(s)) for strategy in STRATEGIES})
    results["held"] = json.dumps(held)
    results["after_step"] = json.dumps(after_step)
    finish_rank(out, rank, results)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    import os

    from tests.e2e.test_parity import free_port

    os.environ["SHARDING_TEST_PORT"] = str(free_port())
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("sharding"))


@pytest.mark.parametrize(("strategy", "share"), [("fsdp", 1 / 4), ("hsdp", 1 / 2), ("ddp", 1.0)])
def test_each_rank_holds_its_share(per_rank: list[dict[str, str]], strategy: str, share: float) -> None:
    for rank, results in enumerate(per_rank):
        assert results[strategy] == "ok", results[strategy]
        held = json.loads(results["held"])[strategy]
        for state in STATES:
            # partitions are padded to a multiple of the group size: a few elements over 33,088
            assert held[state] == pytest.approx(share, abs=0.01), (rank, state, held)


def test_hsdp_replicas_step_alike_and_shards_differ(per_rank: list[dict[str, str]]) -> None:
    """Data ranks 0 and 2 (and 1 and 3) hold the same partition: after a step on different data they
    agree because the gradients were averaged over the replicas; under fsdp all four partitions differ."""
    hsdp = [json.loads(r["after_step"])["hsdp"] for r in per_rank]
    assert hsdp[0] == pytest.approx(hsdp[2], abs=1e-7) and hsdp[1] == pytest.approx(hsdp[3], abs=1e-7)
    assert hsdp[0] != pytest.approx(hsdp[1], abs=1e-4)
    fsdp = [json.loads(r["after_step"])["fsdp"] for r in per_rank]
    assert fsdp[0] != pytest.approx(fsdp[2], abs=1e-4)
