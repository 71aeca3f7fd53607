"""Levanter's Muon, Scion, MARS, Cautious, ADOPT, RMSProp with momentum and Adam-mini at tensor parallelism 2 equal
them at tp 1 (2 gloo ranks, one spawn); before that, at dp 2, MARS and Cautious under ZeRO 1-3 equal ZeRO-0.

Each rank trains the same tiny GPT (GQA, SwiGLU, rotary, untied head: fused column-split QKV and gate/up, row-split
outputs, a vocabulary-split embedding and head) for 3 steps on the same batches with the optimizer Deepy builds,
first at tp 1 (every rank the whole model), then at tp 2 (each rank its slices: Muon and Scion gather each split
matrix, the global norms, Cautious's mask counts and Adam-mini's row-parallel rows' squares are summed over the tp
ranks). The tp-2 weights, put back together, must equal the tp-1 ones within 1e-6 (fp32). The formulas themselves
are tests/unit/test_levanter_whole_tensor_optimizers.py's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.rank_harness import finish_rank, join_data_parallel_ranks, record_checks, run_ranks

WORLD, STEPS = 2, 3
MODEL: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=8,
                             padded_vocab_size=64, seed=3, pos_emb="rotary", activation="swiglu", norm="rmsnorm",
                             intermediate_size=384, no_weight_tying=True, use_bias_in_attn_linear=False)
# no attention biases: the key bias's gradient is rounding noise (softmax ignores a shift of every score), which
# Adam's and signum's normalisations would blow up differently at tp 1 and tp 2; eps 1e-3 for the same reason.
# Scion's signum half is still sign(momentum), which rounding flips where the momentum is ~0: its rate is 0 here
# (the element-wise half needs nothing from the other tp ranks; its clip's tp-summed norm is Muon's, checked), and
# 5 Newton-Schulz steps, not 10: each step multiplies the directions of a (low-rank) momentum's ~0 singular values by
# up to 3.4445, so 10 steps turn rounding differences between the layouts into ~1e-5
# Muon with orthogonalise_sections (q/k/v and gate/up apart: the tp slices joined in the model's order), Scion without
KINDS: dict[str, dict[str, Any]] = {"Muon": {"lr": 0.02, "adam_lr": 0.01, "eps": 1e-3,
                                             "orthogonalise_sections": True}, "Scion": {"lr": 0.02, "scion_to_signum_lr": 0.0, "backend_steps": 5},
                                    "MARS": {"lr": 0.01, "eps": 1e-3}, "Cautious": {"lr": 0.01, "eps": 1e-3},
                                    # element-wise (megatron/engine/levanter_optim.py): each rank steps its slices.
                                    # ADOPT divides by the previous step's sqrt(nu): where that gradient was ~0 the
                                    # layouts' rounding of this one is multiplied by 1/eps (6.6e-6 at eps 1e-3)
                                    "ADOPT": {"lr": 0.01, "eps": 1e-2}, "RMSPropMomentum": {"lr": 0.01, "eps": 1e-3},
                                    # Adam-mini: row-parallel rows' sums and the AdamW clip's norm over the tp ranks
                                    "AdamMini": {"lr": 0.01, "eps": 1e-3, "inner_max_grad_norm": 0.05}}


def _train(kind: str) -> dict[str, torch.Tensor]:
    from megatron import mpu
    from megatron.engine.optimizers import build_optimizer
    from megatron.model import GPTConfig, GPTModel, lm_loss
    from megatron.neox_arguments.loading import config_from_mapping

    from tests.distributed.test_tp_model import _unshard

    cfg = GPTConfig(**MODEL)
    model = GPTModel(cfg)  # the same full weights at any tp (seeded by name)
    args = config_from_mapping({"optimizer": {"type": kind, "params": KINDS[kind]}, "weight_decay": 0.1}).args
    optimizer = build_optimizer(model, args)
    gen = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        tokens, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
        lm_loss(model(tokens), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    return {name: _unshard(cfg, name, p.detach()) for name, p in model.named_parameters()}


# MARS and Cautious under ZeRO at dp 2 (the same spawn, before it turns to tp 2): each rank steps its partition of
# the flat fp32 master; MARS's norm (one group: ZeRO steps groups one at a time) and Cautious's per-stack mask
# counts are summed over the data-parallel ranks. inner_max_grad_norm 0.05 so MARS's clip acts at every step.
ZERO_KINDS: dict[str, dict[str, Any]] = {"MARS": {"lr": 0.01, "eps": 1e-3, "inner_max_grad_norm": 0.05},
                                         "Cautious": {"lr": 0.01, "eps": 1e-3}}


def _zero_train(kind: str, stage: int, sub_group_size: int = 10**9, steps: range = range(STEPS),
                save: str | None = None, load: str | None = None) -> dict[str, torch.Tensor]:
    import deepspeed
    import torch.distributed as dist

    from megatron.engine.build import deepspeed_mpu
    from megatron.engine.optimizers import build_optimizer
    from megatron.model import GPTConfig, GPTModel, lm_loss
    from megatron.neox_arguments.loading import config_from_mapping

    model = GPTModel(GPTConfig(**MODEL))
    args = config_from_mapping({"optimizer": {"type": kind, "params": ZERO_KINDS[kind]}, "weight_decay": 0.1,
                                "gradient_clipping": 0.0}).args
    config = {"train_batch_size": 2 * WORLD, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "sub_group_size": sub_group_size},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, args), config=config,
                                      mpu=deepspeed_mpu())
    gen = torch.Generator().manual_seed(11 + dist.get_rank())  # each rank its own batches
    batches = [(torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen))
               for _ in range(STEPS)]
    if load is not None:
        engine.load_checkpoint(load)
    try:
        for step in steps:
            tokens, labels = batches[step]
            engine.backward(lm_loss(engine(tokens), labels))
            engine.step()
    except RuntimeError:
        engine.destroy()
        raise
    if save is not None:
        engine.save_checkpoint(save)
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=stage == 3):
        got = {k: v.detach().clone() for k, v in params.items()}
    engine.destroy()
    return got


def zero_check(kind: str) -> None:
    from megatron.model import GPTConfig, GPTModel

    want = _zero_train(kind, 0)  # every rank steps the whole model on the averaged gradient
    start = dict(GPTModel(GPTConfig(**MODEL)).named_parameters())
    for name, value in want.items():
        assert not torch.allclose(value, start[name].detach(), atol=1e-4), f"{kind} {name} did not move"
    for stage in (1, 2, 3):
        got = _zero_train(kind, stage)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"{kind} ZeRO-{stage} {name}: max |delta| {diff:.3g} from ZeRO-0"
        if stage != 2:  # resume: 2 steps, DeepSpeed's checkpoint, a new engine takes the third -- the same bits
            where = os.path.join(os.environ["LEVANTER_TP_CKPT"], f"{kind}-{stage}")
            _zero_train(kind, stage, steps=range(2), save=where)
            resumed = _zero_train(kind, stage, steps=range(2, STEPS), load=where)
            for name, value in got.items():
                assert torch.equal(resumed[name], value), f"{kind} ZeRO-{stage} {name}: resumed differs"
    # a group in several ZeRO-3 sub-groups is stepped in several calls, which neither sum can span: stopped
    with pytest.raises(RuntimeError, match="sub_group_size"):
        _zero_train(kind, 3, sub_group_size=256)


SOAP_TP: dict[str, Any] = {"lr": 0.01, "precondition_frequency": 2, "block_size": 40}  # blocks straddle the sections
# Kron (megatron/engine/levanter_kron.py): its factors updated at every step (probability 1), blocks of 40 rows
# straddling the sections, its probes drawn whole on every tp rank
PRECONDITIONED: dict[str, dict[str, Any]] = {"SOAP": SOAP_TP, "Kron": {"lr": 0.01, "block_size": 40,
                                                                      "preconditioner_update_probability": 1.0}}


def _soap_grads() -> list[dict[str, torch.Tensor]]:
    """Whole gradients for SOAP's 3 steps, drawn per step (the tp-1 model's shapes)."""
    from megatron.model import GPTConfig, GPTModel

    gen = torch.Generator().manual_seed(13)
    shapes = {n: p.shape for n, p in GPTModel(GPTConfig(**MODEL)).named_parameters()}
    return [{n: torch.randn(shape, generator=gen) for n, shape in shapes.items()} for _ in range(STEPS)]


def _soap(grads: list[dict[str, torch.Tensor]], kind: str = "SOAP") -> dict[str, torch.Tensor]:
    """SOAP's (or Kron's, megatron/engine/levanter_kron.py) steps (megatron/engine/levanter_soap.py) on the same
    gradient bits at any tp, each rank handed its slices (Kron too: what is checked is its gather, as for SOAP):
    SOAP's eigenbases are unique only up to rotations inside repeated eigenvalues, so the rounding by which a
    tp-2 backward differs could move its update far (in Levanter too, between layouts); what is checked is the
    gather of each split gradient in the model's order -- SOAP cuts rows into blocks, so a fused [q; k; v] or
    [gate; up] gathered in rank order would give other numbers -- and the slice each rank keeps."""
    from megatron import mpu
    from megatron.engine.optimizers import build_optimizer
    from megatron.model import GPTConfig, GPTModel, tp_partition_of
    from megatron.mpu.initialize_weights import shard_tensor
    from megatron.neox_arguments.loading import config_from_mapping

    from tests.distributed.test_tp_model import _unshard

    cfg = GPTConfig(**MODEL)
    model = GPTModel(cfg)
    args = config_from_mapping({"optimizer": {"type": kind, "params": PRECONDITIONED[kind]}, "weight_decay": 0.1}).args
    optimizer = build_optimizer(model, args)
    world, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    for step in grads:
        for name, param in model.named_parameters():
            part = tp_partition_of(cfg, name)
            full = step[name]
            param.grad = full.clone() if part is None else shard_tensor(full, part.dim, rank, world, part.sections)
        optimizer.step()
    if world == 1:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    return {name: _unshard(cfg, name, p.detach()) for name, p in model.named_parameters()}


SOPHIA_VARIANTS: dict[str, dict[str, Any]] = {"SophiaH": {},
                                               # replicated weights with partial gradients per tp rank: the norms
                                               # under sequence parallelism, the per-head q/k norms
                                               "SophiaH sp qk-norm": {"sequence_parallel": True,
                                                                      "use_qk_layernorm": True}}


def _sophia_estimate(extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Sophia-H's Hutchinson estimate ``z * (H z)`` (megatron/engine/levanter_sophia.py's probe) of the tiny GPT's
    loss on one batch, whole (its z is drawn whole and sliced per tp rank); at tp 2 the double backward runs through
    the tp collectives' own backward (mpu.mappings) and the gathered vocabulary's cross-entropy."""
    from megatron import mpu
    from megatron.engine.levanter_sophia import HessianProbe
    from megatron.engine.optimizers import build_optimizer
    from megatron.model import GPTConfig, GPTModel, lm_loss
    from megatron.mpu.cross_entropy import twice_differentiable
    from megatron.neox_arguments.loading import config_from_mapping

    from tests.distributed.test_tp_model import _unshard

    cfg = GPTConfig(**{**MODEL, **extra})
    model = GPTModel(cfg)
    args = config_from_mapping({"optimizer": {"type": "SophiaH", "params": {"lr": 0.01}}}).args
    probe = HessianProbe(model, build_optimizer(model, args), seed=7)
    gen = torch.Generator().manual_seed(17)
    tokens, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    share = 1.0 / mpu.get_data_parallel_world_size()  # each data rank's share (both ranks hold this batch here)
    with twice_differentiable():
        probe.measure(lambda: iter([lm_loss(model(tokens), labels) * share]))
    assert probe._pending is not None
    estimate = {name: e.detach() for (name, _), e in zip(probe.named, probe._pending)}
    if mpu.get_tensor_model_parallel_world_size() == 1:
        return estimate
    return {name: _unshard(cfg, name, e) for name, e in estimate.items()}


def rank_main(rank: int, out: str) -> None:
    from megatron import mpu
    from megatron.engine.levanter_whole_tensor_optim import is_linear_matrix
    from megatron.model import GPTConfig, GPTModel

    join_data_parallel_ranks(rank, WORLD, "LEVANTER_TP_TEST_PORT")  # tp 1, dp 2
    zero = record_checks({f"{kind} ZeRO": (lambda k=kind: zero_check(k)) for kind in ZERO_KINDS})
    want = {kind: _train(kind) for kind in KINDS}
    soap_grads = _soap_grads()
    soap_want = _soap(soap_grads)
    kron_want = _soap(soap_grads, "Kron")
    sophia_want = {kind: _sophia_estimate(extra) for kind, extra in SOPHIA_VARIANTS.items()}
    start = {n: p.detach().clone() for n, p in GPTModel(GPTConfig(**MODEL)).named_parameters()}
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(WORLD, 1)

    def check(kind: str) -> None:
        got = _train(kind)
        for name, value in want[kind].items():
            if kind != "Scion" or is_linear_matrix(name, value):
                assert not torch.allclose(value, start[name], atol=1e-4), f"{kind} {name} did not move"
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"{kind} tp2 {name}: max |delta| {diff:.3g} from tp1"

    def check_soap() -> None:
        got = _soap(soap_grads)
        for name, value in soap_want.items():
            assert not torch.allclose(value, start[name], atol=1e-3), f"SOAP {name} did not move"
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"SOAP tp2 {name}: max |delta| {diff:.3g} from tp1"

    def check_kron() -> None:
        got = _soap(soap_grads, "Kron")
        for name, value in kron_want.items():
            assert not torch.allclose(value, start[name], atol=1e-3), f"Kron {name} did not move"
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6, f"Kron tp2 {name}: max |delta| {diff:.3g} from tp1"

    def check_sophia(kind: str) -> None:
        got = _sophia_estimate(SOPHIA_VARIANTS[kind])
        scale = max(float(v.abs().max()) for v in sophia_want[kind].values())
        assert scale > 1e-3, "the estimate is ~0"
        for name, value in sophia_want[kind].items():
            diff = float((got[name] - value).abs().max())
            assert diff <= 1e-6 * max(1.0, scale), f"{kind} tp2 estimate {name}: max |delta| {diff:.3g} from tp1"

    soap = record_checks({"SOAP": check_soap, "Kron": check_kron,
                          **{k: (lambda k=k: check_sophia(k)) for k in SOPHIA_VARIANTS}})
    finish_rank(out, rank, {**zero, **soap, **record_checks({kind: (lambda k=kind: check(k)) for kind in KINDS})})


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    from tests.e2e.test_parity import free_port

    os.environ["LEVANTER_TP_TEST_PORT"] = str(free_port())
    os.environ["LEVANTER_TP_CKPT"] = str(tmp_path_factory.mktemp("levanter_tp_ckpt"))
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("levanter_tp"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_tp2_equals_tp1(per_rank: list[dict[str, str]], kind: str) -> None:
    for rank, results in enumerate(per_rank):
        assert results[kind] == "ok", f"rank {rank}: {results[kind]}"


def test_soap_tp2_equals_tp1(per_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(per_rank):
        assert results["SOAP"] == "ok", f"rank {rank}: {results['SOAP']}"


def test_kron_tp2_equals_tp1(per_rank: list[dict[str, str]]) -> None:
    for rank, results in enumerate(per_rank):
        assert results["Kron"] == "ok", f"rank {rank}: {results['Kron']}"


@pytest.mark.parametrize("kind", list(SOPHIA_VARIANTS))
def test_sophia_h_estimate_tp2_equals_tp1(per_rank: list[dict[str, str]], kind: str) -> None:
    for rank, results in enumerate(per_rank):
        assert results[kind] == "ok", f"rank {rank}: {results[kind]}"


@pytest.mark.parametrize("kind", list(ZERO_KINDS))
def test_zero1_2_3_equal_unsharded_dp2(per_rank: list[dict[str, str]], kind: str) -> None:
    for rank, results in enumerate(per_rank):
        assert results[f"{kind} ZeRO"] == "ok", f"rank {rank}: {results[f'{kind} ZeRO']}"
