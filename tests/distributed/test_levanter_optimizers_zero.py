"""Levanter's ADOPT, RMSProp-with-momentum, Muon, Scion and Adam-mini under ZeRO on 2 gloo ranks (one spawn) equal
them unsharded.

Each rank builds the same tiny GPT and the optimizer Deepy builds (``build_optimizer``), hands both to a real
DeepSpeed engine (with the hooks ``build_engine`` installs for them) and trains 3 steps, rank r on batch r: at ZeRO
stage 0 (every rank steps the whole model: the reference), then at stage 1 and stage 3 (and 2 for Muon; each rank
steps its shard of the flat fp32 master). The weights must agree within 1e-6 (fp32). ADOPT and RMSprop are
element-wise, so sharding them needs nothing gathered: this checks it. Muon and Scion orthogonalise each whole
matrix (gathered from the data-parallel ranks' partitions) and clip their AdamW/signum half by its global norm over
every group (taken before DeepSpeed steps the groups one at a time); ``inner_max_grad_norm`` is small so that clip
acts at every step; Muon at stages 1 and 3 is also resumed from a DeepSpeed checkpoint written after step 2 (its
momentum and Adam moments are per partition), and must give the same weights. Adam-mini (stages 1-3, resumed at 1
and 3) gathers each whole gradient for its block means and clips its AdamW half by the norm over every group. The
formulas themselves are tests/unit/test_levanter_optimizers.py's and tests/unit/test_levanter_whole_tensor_optimizers.py's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.rank_harness import finish_rank, join_data_parallel_ranks, record_checks, run_ranks

WORLD, STEPS = 2, 3
MODEL: dict[str, Any] = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                             padded_vocab_size=64, seed=3, no_weight_tying=True)
# eps 1e-3: a gradient that differs by rounding between layouts cannot be blown up by 1/(sqrt(v) + eps)
KINDS: dict[str, dict[str, Any]] = {
    "ADOPT": {"lr": 0.01, "eps": 1e-3}, "RMSPropMomentum": {"lr": 0.01, "eps": 1e-3},
    "Muon": {"lr": 0.02, "adam_lr": 0.01, "eps": 1e-3, "inner_max_grad_norm": 0.05, "orthogonalise_sections": True},
    "Scion": {"lr": 0.02, "backend_steps": 5, "inner_max_grad_norm": 0.05},
    "AdamMini": {"lr": 0.01, "eps": 1e-3, "inner_max_grad_norm": 0.05}}
STAGES = {"Muon": (1, 2, 3), "AdamMini": (1, 2, 3)}
"""ZeRO stages compared with stage 0 (default 1 and 3)."""
RESUMED = {"Muon": (1, 3), "AdamMini": (1, 3)}
"""ZeRO stages also resumed from a DeepSpeed checkpoint after step STEPS - 1 (the optimizer's state per partition)."""


def _model() -> torch.nn.Module:
    from megatron.model import GPTConfig, GPTModel

    return GPTModel(GPTConfig(**MODEL))  # the same initial weights on every rank (seeded by name)


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    from megatron.engine.optimizers import build_optimizer
    from megatron.neox_arguments.loading import config_from_mapping

    cfg = config_from_mapping({"optimizer": {"type": kind, "params": KINDS[kind]}, "weight_decay": 0.1,
                               "gradient_clipping": 0.0}).args
    return build_optimizer(model, cfg)


def _tokens(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 7, 3, 9, 5, 3, 7, 11, 9]]) + 5 * rank


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _engine(kind: str, stage: int) -> Any:
    import deepspeed

    from megatron.engine.build import deepspeed_mpu
    from megatron.engine.whole_parameters import attach_whole_parameters
    from megatron.engine.zero_attach import install_zero_pre_step

    model = _model()
    config = {"train_batch_size": WORLD, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if kind in ("Muon", "Scion", "AdamMini"):  # they clip inside the optimizer; Deepy refuses DeepSpeed's clipping
        config["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=model, optimizer=_optimizer(kind, model), config=config,
                                      mpu=deepspeed_mpu())
    attach_whole_parameters(engine.optimizer)  # as build_engine does
    install_zero_pre_step(engine)
    return engine


def _train(kind: str, stage: int, resume: str | None = None) -> dict[str, torch.Tensor]:
    """The weights after STEPS steps; with ``resume`` (a directory) the last step is taken by a new engine that
    loads the checkpoint the first one wrote after STEPS - 1."""
    import deepspeed
    import torch.distributed as dist

    engine = _engine(kind, stage)
    for step in range(STEPS):
        if resume is not None and step == STEPS - 1:
            engine.save_checkpoint(resume, tag=f"{kind}{stage}")
            engine.destroy()
            engine = _engine(kind, stage)
            engine.load_checkpoint(resume, tag=f"{kind}{stage}")
        engine.backward(_loss(engine, _tokens(dist.get_rank())))
        engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=stage == 3):
        got = {k: v.detach().clone() for k, v in params.items()}
    engine.destroy()
    return got


def check(kind: str, out: str) -> None:
    want = _train(kind, 0)
    initial = dict(_model().named_parameters())
    for name, value in want.items():
        assert not torch.allclose(value, initial[name].detach(), atol=1e-4), f"{name} did not move"
    runs = [(stage, None) for stage in STAGES.get(kind, (1, 3))] + [(stage, out) for stage in RESUMED.get(kind, ())]
    for stage, resume in runs:
        got = _train(kind, stage, resume)
        assert sorted(got) == sorted(want)
        how = " resumed after step 2" if resume else ""
        for name, value in want.items():
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"{kind} ZeRO-{stage}{how} {name}: max |delta| {diff:.3g} from ZeRO-0"


# --- SOAP (megatron/engine/levanter_soap.py): whole parameters gathered from the ZeRO partitions -----------------
# SOAP's eigenbases are unique only up to rotations inside repeated eigenvalues (a vector's preconditioner has rank
# <= steps), so gradients that differ by rounding between layouts (the model's backward on a flat buffer's views)
# can move its update far; here the gradients are the same bits at every stage: the loss is linear in the weights,
# with coefficients drawn per rank and step, so the check is the gather and scatter of the whole parameters.
SOAP: dict[str, Any] = {"lr": 0.01, "precondition_frequency": 2, "block_size": 16}
# Kron (megatron/engine/levanter_kron.py) the same way: factors updated at every step, w cut into 16-blocks
PRECONDITIONED: dict[str, dict[str, Any]] = {"SOAP": SOAP, "Kron": {"lr": 0.01, "block_size": 16,
                                                                   "preconditioner_update_probability": 1.0}}


class _Linear(torch.nn.Module):
    """Weights of several shapes (a matrix split into blocks, a vector, sizes no partition divides) and a loss
    linear in them, ``sum(w * c)``: its gradient is exactly the coefficients ``c``."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(24, 20, generator=gen))
        self.v = torch.nn.Parameter(torch.randn(7, generator=gen))
        self.m = torch.nn.Parameter(torch.randn(33, 5, generator=gen))

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip((self.w, self.v, self.m), coeffs))  # type: ignore[return-value]


def _soap_engine(stage: int, kind: str = "SOAP") -> Any:
    import deepspeed

    from megatron.engine.build import deepspeed_mpu
    from megatron.engine.optimizers import build_optimizer
    from megatron.engine.whole_parameters import attach_whole_parameters
    from megatron.neox_arguments.loading import config_from_mapping

    model = _Linear()
    cfg = config_from_mapping({"optimizer": {"type": kind, "params": PRECONDITIONED[kind]}, "weight_decay": 0.1}).args
    config = {"train_batch_size": WORLD, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=config,
                                      mpu=deepspeed_mpu())
    attach_whole_parameters(engine.optimizer)  # as build_engine does
    return engine


def _soap_steps(engine: Any, steps: range) -> dict[str, torch.Tensor]:
    import deepspeed
    import torch.distributed as dist

    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        engine.backward(engine([torch.randn(p.ds_shape if hasattr(p, "ds_shape") else p.shape, generator=gen)
                                for p in engine.module.parameters()]))
        engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None,
                                           enabled=hasattr(params["w"], "ds_id")):
        return {k: v.detach().clone() for k, v in params.items()}


def check_soap(out: str, kind: str = "SOAP") -> None:
    """ZeRO-1, 2 and 3 equal ZeRO-0 after 3 steps (SOAP's preconditioners refreshed at step 2, Kron's factors at
    every step); resuming ZeRO-1 and ZeRO-3 from a checkpoint after step 2 gives the same third step."""
    want = _soap_steps(_soap_engine(0, kind), range(STEPS))
    start = dict(_Linear().named_parameters())
    for name, value in want.items():
        assert not torch.allclose(value, start[name].detach(), atol=1e-3), f"{kind} {name} did not move"
    for stage in (1, 2, 3):
        engine = _soap_engine(stage, kind)
        results = {"": _soap_steps(engine, range(STEPS))}
        if stage in (1, 3):
            engine = _soap_engine(stage, kind)
            _soap_steps(engine, range(STEPS - 1))
            engine.save_checkpoint(out, tag=f"{kind.lower()}{stage}")
            engine = _soap_engine(stage, kind)
            engine.load_checkpoint(out, tag=f"{kind.lower()}{stage}")
            results[" resumed after step 2"] = _soap_steps(engine, range(STEPS - 1, STEPS))
        for how, got in results.items():
            for name, value in want.items():
                diff = float((got[name] - value).abs().max())
                assert diff <= 1e-6, f"{kind} ZeRO-{stage}{how} {name}: max |delta| {diff:.3g} from ZeRO-0"


def rank_main(rank: int, out: str) -> None:
    join_data_parallel_ranks(rank, WORLD, "LEVANTER_OPTIM_TEST_PORT")
    checks = {kind: (lambda k=kind: check(k, out)) for kind in KINDS}
    checks["SOAP"] = lambda: check_soap(out)
    checks["Kron"] = lambda: check_soap(out, "Kron")
    finish_rank(out, rank, record_checks(checks))


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    from tests.e2e.test_parity import free_port

    os.environ["LEVANTER_OPTIM_TEST_PORT"] = str(free_port())
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("levanter_optim"))


@pytest.mark.parametrize("name", KINDS)
def test_zero1_and_zero3_equal_unsharded_dp2(per_rank: list[dict[str, str]], name: str) -> None:
    for rank, results in enumerate(per_rank):
        assert results[name] == "ok", f"rank {rank}: {results[name]}"


def test_soap_zero_equals_unsharded_dp2(per_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(per_rank):
        assert results["SOAP"] == "ok", f"rank {rank}: {results['SOAP']}"


def test_kron_zero_equals_unsharded_dp2(per_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(per_rank):
        assert results["Kron"] == "ok", f"rank {rank}: {results['Kron']}"
