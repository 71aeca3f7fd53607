"""Levanter's SOAP: Deepy's optimizer against Levanter's formulas, its reshaping, resume, and its YAML.

The reference re-writes stanford-crfm/levanter 9263f81e's ``scale_by_soap`` (``src/levanter/optim/soap.py``:
``init_step`` 264-351, ``update_step`` 353-642, ``update_preconditioner``, ``project``/``project_back``,
``get_orthogonal_matrix``, ``get_orthogonal_matrix_QR``) for matrices cut into square blocks, in float64 NumPy with
matrix products (``project(X) = QL^T X QR``, ``project_back(Y) = QL Y QR^T``), independent of the torch code's
tensordots. Square blocks of random gradients make every preconditioner full-rank, so its eigenbasis is unique up
to the columns' signs, which SOAP's update does not depend on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.engine.levanter_soap import Layout, LevanterSoap, merge_small_dims
from megatron.engine.optimizers import build_optimizer
from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import config_from_mapping, load_config

STEPS, LR, WD, BLOCK = 7, 0.01, 0.1, 4


def soap_reference(p: np.ndarray, grads: list[np.ndarray], decay: float, b1: float, b2: float, sb: float,
                   eps: float, freq: int) -> np.ndarray:
    """``clip`` (none here) + ``scale_by_soap`` + ``add_decayed_weights`` + ``scale(-lr)`` for a matrix whose sides
    are multiples of BLOCK (no merging: ``merge_small_dims`` false)."""
    rows, cols = p.shape[0] // BLOCK, p.shape[1] // BLOCK
    idx = [(slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)) for i in range(rows)
           for j in range(cols)]  # BlockPartitioner's order: the first split dimension outermost
    gg = [[np.zeros((BLOCK, BLOCK)), np.zeros((BLOCK, BLOCK))] for _ in idx]
    q: list[list[np.ndarray]] = [[np.eye(BLOCK), np.eye(BLOCK)] for _ in idx]
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        u = np.zeros_like(p)
        if t == 1:  # init_step: GG from this gradient, Q its eigenvectors (descending), no update
            for k, s in enumerate(idx):
                gg[k] = [(1 - sb) * g[s] @ g[s].T, (1 - sb) * g[s].T @ g[s]]
                q[k] = [np.flip(np.linalg.eigh(x + eps * np.eye(BLOCK))[1], axis=1) for x in gg[k]]
        else:
            m = (1 - b1) * g + b1 * m  # tree_update_moment(updates, exp_avg, b1, 1)
            corr = np.sqrt(1 - b2**t) / (1 - b1**t)
            for k, s in enumerate(idx):
                ql, qr = q[k]
                v[s] = (1 - b2) * (ql.T @ g[s] @ qr) ** 2 + b2 * v[s]
                u[s] = ql @ ((ql.T @ m[s] @ qr) / (np.sqrt(v[s]) + eps)) @ qr.T * corr
                old = gg[k]
                gg[k] = [old[0] + (1 - sb) * (g[s] @ g[s].T - old[0]), old[1] + (1 - sb) * (g[s].T @ g[s] - old[1])]
                if t % freq == 0:  # get_orthogonal_matrix_QR with the GG from before this step
                    block_v = v[s].copy()
                    for axis in range(2):
                        est = np.diag(q[k][axis].T @ old[axis] @ q[k][axis])
                        order = np.argsort(-est, kind="stable")
                        block_v = np.take(block_v, order, axis=axis)
                        q[k][axis] = np.linalg.qr(old[axis] @ q[k][axis][:, order])[0]
                    v[s] = block_v
        p = p + (-LR) * (u + decay * p)
    return p


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 8))
        self.b = torch.nn.Parameter(torch.randn(4, 12))


def gradients(shape: torch.Size, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (0.5 + i) for i in range(STEPS)]


@pytest.mark.parametrize(("betas", "shampoo_beta", "eps", "freq"), [((0.95, 0.95), 0.95, 1e-8, 2),
                                                                     ((0.9, 0.99), 0.8, 1e-6, 3)])
def test_update_over_steps_equals_levanters_formula(betas: tuple[float, float], shampoo_beta: float, eps: float,
                                                    freq: int) -> None:
    model = Tiny()
    start = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: gradients(p.shape, seed) for seed, (n, p) in enumerate(model.named_parameters())}
    params = {"lr": LR, "betas": list(betas), "shampoo_beta": shampoo_beta, "eps": eps, "precondition_frequency": freq,
              "merge_small_dims": False, "block_size": BLOCK}
    cfg = config_from_mapping({"optimizer": {"type": "SOAP", "params": params}, "weight_decay": WD}).args
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, LevanterSoap)
    torch.set_default_dtype(torch.float64)  # the reference's precision: 1e-6 over 7 eigen/QR refreshes
    try:
        model.double()
        for step in range(STEPS):
            for name, p in model.named_parameters():
                p.grad = grads[name][step].double()
            optimizer.step()
    finally:
        torch.set_default_dtype(torch.float32)
    for name, p in model.named_parameters():
        expected = soap_reference(start[name], [g.double().numpy() for g in grads[name]], WD, *betas, shampoo_beta,
                                  eps, freq)
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=0, atol=1e-6)
        plain = start[name] * (1 - LR * WD) ** STEPS  # the decay alone: the preconditioned steps moved it further
        assert not np.allclose(expected, plain, atol=1e-3)


def test_fp32_stays_near_the_float64_reference() -> None:
    model = Tiny()
    start = model.a.detach().double().numpy().copy()
    grads = gradients(model.a.shape, 5)
    optimizer = LevanterSoap([model.a], lr=LR, betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8,
                             precondition_frequency=2, max_precond_dim=10000, merge_small_dims=False,
                             target_merged_dim_size=2048, one_diag=False, partition_grads_into_blocks=True,
                             block_size=BLOCK, weight_decay=WD)
    for g in grads:
        model.a.grad = g.clone()
        optimizer.step()
    expected = soap_reference(start, [g.double().numpy() for g in grads], WD, 0.95, 0.95, 0.95, 1e-8, 2)
    np.testing.assert_allclose(model.a.detach().double().numpy(), expected, rtol=0, atol=1e-5)


def test_reshaping_follows_levanters_merge_and_blocks() -> None:
    # _merge_small_dims' dim2loss (soap.py:1036-1110) worked by hand: 64*64 = 4096 costs 10*log2(2) = 10, two 64s
    # cost 2*(log2(32) + 100*log2(4)) = 410; 768 stays (2*log2(2048/768) against 10*log2(288) + 1000*log2(36))
    assert merge_small_dims((64, 64), 2048, [False, False]) == ([4096], [False])
    assert merge_small_dims((768, 768), 2048, [False, False]) == ([768, 768], [False, False])
    assert merge_small_dims((1, 1), 2048, [False, False]) == ([1], [True])
    vocab = Layout((50257, 768), 10000, True, 2048, False, True, 256)
    assert vocab.merged == (50257, 768) and vocab.block == (50432, 256) and vocab.preconditioned == [False, True]
    x = torch.randn(10, 7)
    layout = Layout((10, 7), 10000, False, 2048, False, True, 4)
    blocks = layout.blocks(x)  # rows 4, 4, 2 x cols 4, 3: six blocks, each padded to 4 x 4
    assert len(blocks) == 6 and all(b.shape == (4, 4) for b in blocks)
    assert torch.equal(blocks[1][:, :3], x[0:4, 4:7]) and torch.equal(blocks[4][:2], x[8:10, 0:4])
    assert torch.equal(layout.merge(blocks), x)


def test_resume_from_the_state_dict_is_exact() -> None:
    def fresh() -> tuple[torch.nn.Parameter, LevanterSoap]:
        p = torch.nn.Parameter(torch.ones(8, 6))
        return p, LevanterSoap([p], lr=LR, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, precondition_frequency=2,
                               max_precond_dim=10000, merge_small_dims=True, target_merged_dim_size=16,
                               one_diag=False, partition_grads_into_blocks=True, block_size=4, weight_decay=WD)

    grads = gradients(torch.Size([8, 6]), 9)

    def run(p: torch.nn.Parameter, opt: LevanterSoap, steps: range) -> None:
        for i in steps:
            p.grad = grads[i].clone()
            opt.step()

    straight, opt = fresh()
    run(straight, opt, range(STEPS))
    first, opt = fresh()
    run(first, opt, range(3))
    saved, weights = opt.state_dict(), first.detach().clone()
    resumed, opt = fresh()
    with torch.no_grad():
        resumed.copy_(weights)
    opt.load_state_dict(saved)
    run(resumed, opt, range(3, STEPS))
    assert torch.equal(resumed.detach(), straight.detach())


MODEL = "model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"


def load(tmp_path: Path, text: str) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(MODEL + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


# SoapConfig (soap.py:29-49@9263f81e): weight_decay 0.0, beta1 0.95, beta2 0.95, shampoo_beta 0.95, epsilon 1e-8,
# max_grad_norm 1.0, precondition_frequency 10, max_precond_dim 10000, merge_small_dims true, one_diag false,
# target_merged_dim_size 2048, partition_grads_into_blocks true, block_size 256; OptimizerConfig's learning_rate 6e-4
@pytest.mark.parametrize(("text", "want"), [
    ("optimizer:\n  type: soap\n", dict(betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8, precondition_frequency=10,
                                        max_precond_dim=10000, merge_small_dims=True, target_merged_dim_size=2048,
                                        one_diag=False, partition_grads_into_blocks=True, block_size=256,
                                        weight_decay=0.0, clip=1.0)),
    ("optimizer:\n  type: soap\n  beta2: 0.99\n  shampoo_beta: 0.9\n  precondition_frequency: 5\n  block_size: 128\n"
     "  merge_small_dims: false\n  weight_decay: 0.1\n  max_grad_norm: 0.5\n  schedule_list: [a]\n",
     dict(betas=(0.95, 0.99), shampoo_beta=0.9, eps=1e-8, precondition_frequency=5, max_precond_dim=10000,
          merge_small_dims=False, target_merged_dim_size=2048, one_diag=False, partition_grads_into_blocks=True,
          block_size=128, weight_decay=0.1, clip=0.5)),
])
def test_levanter_yaml_builds_soap_with_levanters_defaults(tmp_path: Path, text: str, want: dict[str, Any]) -> None:
    args = load(tmp_path, text)
    optimizer = build_optimizer(Tiny(), args)
    assert type(optimizer) is LevanterSoap
    for key in ("betas", "shampoo_beta", "eps", "precondition_frequency", "max_precond_dim", "merge_small_dims",
                "target_merged_dim_size", "one_diag", "partition_grads_into_blocks", "block_size"):
        assert optimizer.defaults[key] == want[key], key
    assert optimizer.defaults["lr"] == 6e-4
    assert optimizer.param_groups[0]["weight_decay"] == want["weight_decay"]
    assert args.gradient_clipping == want["clip"]


@pytest.mark.parametrize(("text", "words"), [
    ("optimizer:\n  type: adam\n  shampoo_beta: 0.9\n", "only Levanter's soap optimizer has shampoo_beta"),
    ("optimizer:\n  type: soap\n  mu_dtype: bfloat16\n", "mu_dtype: null"),
])
def test_what_soap_does_not_have_is_refused(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, text)


LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0, optimizer={"type": "SOAP"})


def test_soap_layouts_before_launch() -> None:
    """ZeRO 1-3 and tensor parallelism run (tests/distributed/test_levanter_optimizers_zero.py and
    test_levanter_whole_tensor_tp.py show them equal to one rank); what the gather cannot reach is refused by name."""
    from megatron.config_rules import Device
    from megatron.neox_arguments.derived import finalize

    cpu = Device(cuda=False, fp16_supported=False)
    for keys in ({"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 2}, "model_parallel_size": 2},
                 {"zero_optimization": {"stage": 3}}, {"model_parallel_size": 2}):
        finalize(config_from_mapping({**LAUNCH, **keys}), 2, device=cpu)
    for keys, words in (({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                         "remove offload_optimizer"),
                        ({"zero_optimization": {"stage": 1}, "precision": "bfloat16"}, "BF16_Optimizer"),
                        ({"pipe_parallel_size": 1, "precision": "bfloat16"}, "flat fp32 buffer")):
        with pytest.raises(ConfigError, match=words):
            finalize(config_from_mapping({**LAUNCH, **keys}), 2, device=cpu)



def test_build_engine_attaches_zero_partitions(one_rank: Any) -> None:
    """build_engine hands SOAP the ZeRO-3 layout (what Levanter's FSDP maps to): the trainer's step runs SOAP on the
    whole parameters cut from the flat partition, and 3 steps equal the same run at ZeRO stage 0."""
    from megatron.config_rules import Device
    from megatron.engine.build import build_engine
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.step import train_step

    def run(stage: int) -> tuple[dict[str, torch.Tensor], int]:
        keys = {**LAUNCH, "optimizer": {"type": "SOAP", "params": {"lr": 0.01, "precondition_frequency": 2,
                                                                       "merge_small_dims": False,
                                                                       "partition_grads_into_blocks": False}},
                "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "hidden_dropout": 0.0,
                "attention_dropout": 0.0, "lr": None}
        cfg = RunConfig.from_resolved(finalize(config_from_mapping(keys), 1,
                                               device=Device(cuda=False, fp16_supported=False)))
        eng = build_engine(cfg, cfg.model.with_vocab(64), 4)
        gen = torch.Generator().manual_seed(1)
        batches = iter([{"text": torch.randint(0, 64, (1, 9), generator=gen)} for _ in range(6)])
        for _ in range(3):
            train_step(eng, batches, torch.device("cpu"))
        base = eng.optimizer.optimizer if stage else eng.optimizer
        assert isinstance(base, LevanterSoap)
        import deepspeed  # lazy: the engine's own gather of ZeRO-3 weights, used in this test only

        params = dict(eng.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
            return {k: v.detach().clone() for k, v in params.items()}, len(base.zero)

    want, none = run(0)
    got, flats = run(3)
    assert none == 0 and flats >= 1
    for name, value in want.items():
        diff = float((got[name] - value).abs().max())
        assert diff <= 1e-6, f"SOAP ZeRO-3 {name}: max |delta| {diff:.3g} from ZeRO-0"
