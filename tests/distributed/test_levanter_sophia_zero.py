"""Levanter's Sophia-H through the trainer's step on 2 gloo ranks (one spawn): ZeRO-1, 2 and 3 equal ZeRO-0.

Each rank builds the same tiny GPT and Deepy's Sophia-H (``build_optimizer``), hands both to a real DeepSpeed engine
and trains 4 steps of 2 micro-batches each through the trainer's own step (``ObjectiveRunner.run`` with the engine's
``HessianProbe``), the Hessian estimated every 2nd step: at ZeRO stage 0 (every rank steps the whole model: the
reference), then at stages 1, 2 and 3 (each rank steps its shard of the flat fp32 master; the estimate reaches the
shard through DeepSpeed's fragment mapping; at stage 3 the probe holds the weights whole while it runs), those with
DeepSpeed's (reentrant) activation checkpointing on, which the probe's double differentiation must run without. The weights must agree within 1e-6 (fp32), the Hessian EMA must
be non-zero (the estimate arrived). The formulas themselves, and that the estimates change the update, are
tests/unit/test_levanter_sophia.py's.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.distributed.rank_harness import finish_rank, join_data_parallel_ranks, record_checks, run_ranks

WORLD, STEPS, MICRO = 2, 4, 2
MODEL: dict[str, Any] = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8,
                             padded_vocab_size=64, seed=3, no_weight_tying=True)


def _model(recompute: bool) -> torch.nn.Module:
    from megatron.engine.activation_config import ActivationCheckpointArgs
    from megatron.engine.build import configure_activation_checkpointing, wrap_layers
    from megatron.model import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**MODEL))  # the same initial weights on every rank (seeded by name)
    if recompute:
        cfg = ActivationCheckpointArgs(checkpoint_activations=True)
        configure_activation_checkpointing(cfg, MODEL["num_layers"])
        wrap_layers(model, cfg, compile_layers=False, pipe_interval_used=False)
    return model


def _samples(rank: int) -> list[dict[str, torch.Tensor]]:
    base = torch.tensor([[1, 7, 3, 9, 5, 3, 7, 11, 9]])
    return [{"text": (base * (i + 1) + 5 * rank) % 64} for i in range(STEPS * MICRO)]


def _train(stage: int, recompute: bool) -> tuple[dict[str, torch.Tensor], float]:
    import deepspeed

    from megatron.engine.build import deepspeed_mpu, recompute_suspended
    from megatron.engine.levanter_sophia import HessianProbe, base_sophia
    from megatron.engine.optimizers import build_optimizer
    from megatron.neox_arguments.loading import config_from_mapping
    from megatron.objectives import LMObjective, ObjectiveArgs, Reference
    from megatron.training.objective_runner import ObjectiveRunner

    model = _model(recompute)
    params = {"lr": 0.01, "eps": 1e-6, "gamma": 0.5, "clip_threshold": 0.3, "update_interval": 2, "rng_seed": 5}
    cfg = config_from_mapping({"optimizer": {"type": "SophiaH", "params": params}, "weight_decay": 0.1}).args
    config = {"train_batch_size": WORLD * MICRO, "train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=config,
                                                 mpu=deepspeed_mpu())
    probe = HessianProbe(engine.module, optimizer, 5, suspend_recompute=recompute_suspended)
    handle = SimpleNamespace(engine=engine, is_pipe=False, before_update=None, after_forward_only=None,
                             hessian_probe=probe)
    runner = ObjectiveRunner(LMObjective(ObjectiveArgs()), Reference())
    samples = iter(_samples(torch.distributed.get_rank()))
    for _ in range(STEPS):
        runner.run(handle, samples, "train", torch.device("cpu"), train=True)
    sophia = base_sophia(optimizer)
    assert sophia is not None
    h_norm = sum(float(s["h"].abs().sum()) for s in sophia.state.values())
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=stage == 3):
        got = {k: v.detach().clone() for k, v in params.items()}
    engine.destroy()
    return got, h_norm


def check() -> None:
    want, h_norm = _train(0, recompute=False)
    assert h_norm > 0, "no Hessian estimate reached ZeRO-0's optimizer"
    initial = dict(_model(False).named_parameters())
    for name, value in want.items():
        assert not torch.allclose(value, initial[name].detach(), atol=1e-4), f"{name} did not move"
    for stage in (1, 2, 3):
        got, h_norm = _train(stage, recompute=True)
        assert h_norm > 0, f"no Hessian estimate reached ZeRO-{stage}'s shard"
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"Sophia-H ZeRO-{stage} {name}: max |delta| {diff:.3g} from ZeRO-0"


def rank_main(rank: int, out: str) -> None:
    join_data_parallel_ranks(rank, WORLD, "LEVANTER_SOPHIA_TEST_PORT")
    finish_rank(out, rank, record_checks({"sophia_h": check}))


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    from tests.e2e.test_parity import free_port

    os.environ["LEVANTER_SOPHIA_TEST_PORT"] = str(free_port())
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("levanter_sophia"))


def test_sophia_h_zero1_2_3_equal_unsharded_dp2(per_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(per_rank):
        assert results["sophia_h"] == "ok", f"rank {rank}: {results['sophia_h']}"
