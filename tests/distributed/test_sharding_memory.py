"""What each rank holds under each ``sharding_strategy``, read from DeepSpeed's own state on 4 gloo
ranks (one spawn, in-process): the DeepSpeed config is the one Deepy derives from the key.

- fsdp (ZeRO-3 over 4): every rank's parameter shard (``ds_tensor``) and its fp32 optimizer partition
  are 1/4 of the model.
- hsdp as 2 "nodes" of 2 (ZeRO++ hpZ, partition 2): the node-local parameter copy
  (``ds_secondary_tensor``) is 1/2 of the model, the primary shard and the optimizer states stay 1/4.
- ddp (stage 0): every rank holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.rank_harness import finish_rank, record_checks, run_ranks

WORLD = 4
STRATEGIES = ("fsdp", "hsdp", "ddp")


def deepy_zero_block(strategy: str) -> dict:
    from megatron.neox_arguments import config_from_mapping, finalize
    from megatron.config_rules import Device

    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=1, lr=1e-3,
                  train_micro_batch_size_per_gpu=1, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                  sharding_strategy=strategy, num_gpus=WORLD)
    if strategy == "hsdp":
        values["zero_optimization"] = {"zero_hpz_partition_size": 2}
    resolved = finalize(config_from_mapping(values), WORLD, device=Device(cuda=False, fp16_supported=False))
    return resolved.deepspeed_config["zero_optimization"]


def rank_main(rank: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["SHARDING_TEST_PORT"], RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    skip_shared_memory_comm_op()
    dist.init_process_group("gloo")
    held: dict[str, dict[str, float]] = {}

    def measure(strategy: str) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        total = sum(p.numel() for p in model.parameters())
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": deepy_zero_block(strategy),
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**6}
        engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        loss = engine(torch.randn(1, 64)).pow(2).mean()
        engine.backward(loss)
        # after the forward/backward the gathered parameters are released: hpZ keeps its node-local
        # copy for the next gather (the optimizer step refreshes it), so it is read here
        params = list(engine.module.parameters())
        primary = sum(p.ds_tensor.numel() for p in params) if hasattr(params[0], "ds_tensor") else total
        secondary = sum(p.ds_secondary_tensor.numel() for p in params
                        if getattr(p, "ds_secondary_tensor", None) is not None)
        engine.step()  # one step, so the optimizer states exist
        states = engine.optimizer.optimizer.state if hasattr(engine.optimizer, "optimizer") else engine.optimizer.state
        exp_avg = sum(s["exp_avg"].numel() for s in states.values() if "exp_avg" in s)
        held[strategy] = {"primary": primary / total, "secondary": secondary / total, "exp_avg": exp_avg / total}
        engine.destroy()

    results = record_checks({strategy: (lambda s=strategy: measure(s)) for strategy in STRATEGIES})
    results["held"] = json.dumps(held)
    finish_rank(out, rank, results)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    import os

    from tests.e2e.test_parity import free_port

    os.environ["SHARDING_TEST_PORT"] = str(free_port())
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("sharding"))


@pytest.mark.parametrize(("strategy", "primary", "secondary", "exp_avg"), [
    ("fsdp", 1 / 4, 0.0, 1 / 4),
    ("hsdp", 1 / 4, 1 / 2, 1 / 4),
    ("ddp", 1.0, 0.0, 1.0),
])
def test_each_rank_holds_its_share(per_rank: list[dict[str, str]], strategy: str, primary: float,
                                   secondary: float, exp_avg: float) -> None:
    for rank, results in enumerate(per_rank):
        assert results[strategy] == "ok", results[strategy]
        held = json.loads(results["held"])[strategy]
        assert held["primary"] == pytest.approx(primary, abs=0.01), (rank, held)
        assert held["secondary"] == pytest.approx(secondary, abs=0.01), (rank, held)
        assert held["exp_avg"] == pytest.approx(exp_avg, abs=0.01), (rank, held)
