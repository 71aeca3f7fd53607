"""Levanter's Kron (PSGD): Deepy's optimizer against Levanter's formulas, its reshaping, resume, and its block.

The reference re-writes stanford-crfm/levanter 9263f81e's ``KronConfig`` chain (``src/levanter/optim/kron.py``:
``scale_by_kron``'s ``update_fn`` 485-918, ``_conjB``, ``_update_precond``, ``_precond_grad``, ``_norm_lower_bound``,
``_balance_Q``, ``precond_update_prob_schedule``; then ``clip_by_block_rms(1.1)``, ``add_decayed_weights``,
``scale_by_learning_rate``) in float64 NumPy with matrix products and explicit inverses (``A = Q0 G Q1^T``,
``conjB = Q0^-T V Q1^-1``, ``P = Q0^T Q0 G Q1^T Q1``), independent of the torch code's tensordots and triangular
solves. The layouts of the three test parameters are derived by hand from kron.py's ``_merge_small_dims``,
``BlockPartitioner`` and ``_pad_and_stack_matrices`` (comments at ``LAYOUTS``). The probes are the ones Deepy draws
(``draw_probes``: Levanter's come from JAX's generator, which no re-computation can share).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from megatron.engine.levanter_kron import LevanterKron, draw_probes
from megatron.engine.optimizers import build_optimizer

LR, WD, BLOCK, TARGET = 0.01, 0.1, 4, 16
SHAPES = [(10, 6), (5,), (3, 4)]
# block_size 4, target_merged_dim_size 16:
# (10, 6): kept (dim2loss(60) = 10*log2(60/16) > log2(16/10) + log2(16/6)); both dims triangular (2 dims >= 2), cut
#          rows 4,4,2 x cols 4,2 -> 6 blocks (rows outermost), each padded to 4x4.
# (5,):    one dim < min_ndim_triangular 2 -> diagonal, not cut, padded to 8.
# (3, 4):  merged to 12 (log2(16/12) < log2(16/3) + log2(16/4)), triangular (merged from triangular dims), cut
#          4,4,4 -> 3 blocks of 4.
LAYOUTS: list[tuple[list[tuple[slice, ...]], tuple[int, ...], bool]] = [
    ([(slice(r, r + 4), slice(c, c + 4)) for r in (0, 4, 8) for c in (0, 4)], (4, 4), False),
    ([(slice(0, 5),)], (8,), True),
    ([(slice(b, b + 4),) for b in (0, 4, 8)], (4,), False),
]
MERGED = [(10, 6), (5,), (12,)]
TINY32 = float(np.finfo(np.float32).tiny)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """4x4 blocks: torch's thread pool only costs time here (seconds on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _nlb(a: np.ndarray) -> float:
    """``_norm_lower_bound`` (kron.py:1200-1220)."""
    m = float(np.max(np.abs(a)))
    if m == 0:
        return 0.0
    a = a / m
    x = a[:, int(np.argmax(np.sum(a * a, axis=0)))] @ a
    return m * float(np.linalg.norm((x / np.linalg.norm(x)) @ a.T))


def _update(qs: list[np.ndarray], g: np.ndarray, v: np.ndarray, lr_p: float, diag: bool) -> list[np.ndarray]:
    """``_update_precond`` with ``_conjB`` for one block (a 4x4 matrix or a vector)."""
    if g.ndim == 2:
        q0, q1 = qs
        a = q0 @ g @ q1.T
        b = np.linalg.inv(q0).T @ v @ np.linalg.inv(q1)
        out = []
        for q, t1, t2 in ((q0, a @ a.T, b @ b.T), (q1, a.T @ a, b.T @ b)):
            out.append(q - lr_p / (_nlb(t1 + t2) + TINY32) * np.triu(t1 - t2) @ q)
        return out
    (q,) = qs
    if diag:
        a, b = q * g, v / q
        t1, t2 = a * a, b * b
        return [q - lr_p / (np.max(np.abs(t1 + t2)) + TINY32) * (t1 - t2) * q]
    a, b = q @ g, np.linalg.inv(q).T @ v
    t1, t2 = np.outer(a, a), np.outer(b, b)
    return [q - lr_p / (_nlb(t1 + t2) + TINY32) * np.triu(t1 - t2) @ q]


def _precond(qs: list[np.ndarray], g: np.ndarray, diag: bool) -> np.ndarray:
    if g.ndim == 2:
        return qs[0].T @ qs[0] @ g @ qs[1].T @ qs[1]
    return qs[0] ** 2 * g if diag else qs[0].T @ qs[0] @ g


def kron_reference(params: list[np.ndarray], grads: list[list[np.ndarray]], b1: float, min_prob: float,
                   flat_start: int, lr_p: float, init_scale: float, seed: int
                   ) -> tuple[list[np.ndarray], list[list[list[np.ndarray]]]]:
    """The parameters after every step of ``grads`` (one list per step), and the final factors."""
    params = [p.copy() for p in params]
    mus = [np.zeros_like(p) for p in params]
    qs_all = []
    for (idx, block, diag), p in zip(LAYOUTS, params):
        scale = init_scale ** (1 / len(block))
        qs_all.append([[scale * (np.ones(s) if diag else np.eye(s)) for s in block] for _ in idx])
    counter = balances = 0
    for t, step_grads in enumerate(grads, start=1):
        prob = min(max(math.exp(-0.001 * (t - flat_start)), min_prob), 1.0)
        counter += 1
        do_update = counter >= 1 / prob
        do_balance = False
        if do_update:
            counter = 0
            balances += 1
            do_balance = balances >= 100
            balances = 0 if do_balance else balances
        for k, (g, (idx, block, diag)) in enumerate(zip(step_grads, LAYOUTS)):
            mus[k] = b1 * mus[k] + (1 - b1) * g
            m = (mus[k] / (1 - b1**t)).reshape(MERGED[k])
            blocks = []
            for s in idx:
                piece = np.zeros(block)
                part = m[s]
                piece[tuple(slice(0, n) for n in part.shape)] = part
                blocks.append(piece)
            if do_update:
                if do_balance:
                    for j, qs in enumerate(qs_all[k]):
                        norms = np.array([np.max(np.abs(q)) for q in qs])
                        gmean = np.exp(np.mean(np.log(norms)))
                        qs_all[k][j] = [q * gmean / n for q, n in zip(qs, norms)]
                probes = draw_probes(seed, t, k, (len(blocks), *block)).double().numpy()
                damp = math.sqrt(np.finfo(np.float32).eps) * np.mean(np.abs(np.stack(blocks)))
                qs_all[k] = [_update(qs, b + damp * v, v, lr_p, diag) for qs, b, v in zip(qs_all[k], blocks, probes)]
            u = np.zeros_like(m)
            for s, qs, b in zip(idx, qs_all[k], blocks):
                out = _precond(qs, b, diag)
                u[s] = out[tuple(slice(0, n) for n in u[s].shape)]
            u = u.reshape(g.shape)
            u = u / max(1.0, math.sqrt(np.mean(u * u)) / 1.1)
            params[k] = params[k] - LR * (u + WD * params[k])
    return params, qs_all


def _data(steps: int, seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) * (1 + i) for i, s in enumerate(SHAPES)] for _ in range(steps)]
    return params, grads


def _deepy(params: list[np.ndarray], grads: list[list[np.ndarray]], dtype: torch.dtype, **kw: Any
           ) -> tuple[list[torch.nn.Parameter], LevanterKron]:
    ps = [torch.nn.Parameter(torch.tensor(p, dtype=dtype)) for p in params]
    opt = LevanterKron(ps, lr=LR, weight_decay=WD, block_size=BLOCK, target_merged_dim_size=TARGET, **kw)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return ps, opt


CASES = {  # (beta1, preconditioner_update_probability, update_prob_flat_start, preconditioner_lr, init scale)
    "levanter_defaults": (0.9, 0.05, 500, 0.1, 1.0),  # p = 1 for the first 500 steps: every step updates
    "every_third_step": (0.95, 0.4, -1000, 0.2, 2.0),  # p = clip(exp(-0.001 (t + 1000)), 0.4, 1) = 0.4: 1/p = 2.5
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_over_steps_equals_levanters_formula(case: str) -> None:
    """Seven steps in float64 (factors too) equal the float64 re-computation, factors included; the preconditioner
    is updated on the steps the counter says (a wrong counter or schedule moves the factors)."""
    b1, prob, flat, lr_p, scale = CASES[case]
    params, grads = _data(7)
    want, want_q = kron_reference(params, grads, b1, prob, flat, lr_p, scale, seed=3)
    got, opt = _deepy(params, grads, torch.float64, beta1=b1, preconditioner_update_probability=prob,
                      update_prob_flat_start=flat, preconditioner_lr=lr_p, preconditioner_init_scale=scale, seed=3,
                      precond_dtype=torch.float64)
    for p, w in zip(got, want):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=1e-10)
    for p, wq in zip(got, want_q):
        for qs, wqs in zip(opt.state[p]["Q"], wq):
            for q, w in zip(qs, wqs):
                np.testing.assert_allclose(q.numpy(), w, rtol=0, atol=1e-10)
    assert opt.param_groups[0]["kron_update_counter"] == (0 if case == "levanter_defaults" else 1)


def test_fp32_with_levanters_defaults_stays_within_1e6() -> None:
    """Levanter's dtypes (float32 parameters and factors) over five steps: within 1e-6 of the float64 formula."""
    params, grads = _data(5, seed=1)
    want, _ = kron_reference(params, grads, 0.9, 0.05, 500, 0.1, 1.0, seed=0)
    got, _ = _deepy(params, grads, torch.float32)
    for p, w in zip(got, want):
        np.testing.assert_allclose(p.detach().double().numpy(), w, rtol=0, atol=1e-6)


def test_factors_are_balanced_on_the_hundredth_update() -> None:
    """``_balance_Q`` runs when the balance counter reaches 100 updates (before the 100th update): the factors then
    equal the float64 formula's, which balances; the two factors of a matrix block had drifted apart in scale
    before it, so a missing balance would leave them off by that scale."""
    params, grads = _data(100, seed=2)
    want, want_q = kron_reference(params, grads, 0.9, 0.05, 500, 0.1, 1.0, seed=0)
    got, opt = _deepy(params, grads[:99], torch.float64, precond_dtype=torch.float64)
    b0, b1 = (q.clone() for q in opt.state[got[0]]["Q"][0])
    assert abs(math.log(b0.abs().max().item() / b1.abs().max().item())) > 1e-3
    for p, g in zip(got, grads[99]):
        p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    assert opt.param_groups[0]["kron_balance_counter"] == 0
    for qs, wqs in zip(opt.state[got[0]]["Q"], want_q[0]):
        for q, w in zip(qs, wqs):
            np.testing.assert_allclose(q.numpy(), w, rtol=1e-5, atol=1e-9)  # 100 updates' rounding
    np.testing.assert_allclose(got[0].detach().numpy(), want[0], rtol=0, atol=1e-7)


def test_layout_follows_levanters_merge_blocks_and_diagonals() -> None:
    opt = LevanterKron([torch.nn.Parameter(torch.zeros(1))], lr=1.0, block_size=BLOCK,
                       target_merged_dim_size=TARGET)
    got = [(lay.merged, lay.block, lay.diag) for lay in (opt.layout(s) for s in SHAPES)]
    assert got == [((10, 6), (4, 4), [False, False]), ((5,), (8,), [True]), ((12,), (4,), [False])]
    defaults = LevanterKron([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    # Levanter's defaults: a 50304-row vocabulary is longer than max_size_triangular 25000 -> diagonal, not cut
    emb = defaults.layout((50304, 768))
    assert emb.diag == [True, False] and emb.block == (50432, 256)
    one_diag = LevanterKron([torch.nn.Parameter(torch.zeros(1))], lr=1.0, memory_save_mode="one_diag",
                            merge_small_dims=False)
    assert one_diag.layout((64, 512)).diag == [False, True]  # the largest dim diagonal
    # merged first: (64, 512) becomes one 32768 vector, triangular (all of its dims were), cut into 256-blocks
    assert defaults.layout((64, 512)).diag == [False] and defaults.layout((64, 512)).block == (256,)


def test_resume_from_the_state_dict_is_exact() -> None:
    """Three steps, the state dict into a fresh optimizer, three more: bitwise the six-step run (the counters and
    the step live in the state dict, the probes are drawn from the step)."""
    params, grads = _data(6, seed=4)
    kw: dict[str, Any] = {"preconditioner_update_probability": 0.4, "update_prob_flat_start": -1000}
    straight, _ = _deepy(params, grads, torch.float32, **kw)
    first, opt = _deepy(params, grads[:3], torch.float32, **kw)
    saved = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = LevanterKron(resumed, lr=LR, weight_decay=WD, block_size=BLOCK, target_merged_dim_size=TARGET, **kw)
    opt2.load_state_dict(saved)
    for step_grads in grads[3:]:
        for p, g in zip(resumed, step_grads):
            p.grad = torch.tensor(g, dtype=torch.float32)
        opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0, weight_decay=0.1)


def _finalize(keys: dict[str, Any], world: int = 1) -> Any:
    from megatron.config_rules import Device
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.loading import config_from_mapping

    return finalize(config_from_mapping({**LAUNCH, **keys}), world, device=Device(cuda=False, fp16_supported=False))


def test_the_kron_block_builds_levanters_defaults_and_its_own_values() -> None:
    """``optimizer: {type: Kron}``: KronConfig's defaults (kron.py:90-112@9263f81e), and each given param reaches
    the optimizer (the formula tests above show what each one does there)."""
    from megatron.neox_arguments.loading import config_from_mapping

    args = config_from_mapping({"optimizer": {"type": "Kron"}, "weight_decay": 0.1, "lr": 1e-3}).args
    model = torch.nn.Linear(24, 40, bias=False)
    opt = build_optimizer(model, args)
    assert isinstance(opt, LevanterKron)
    assert (opt.beta1, opt.normalize_grads, opt.min_prob, opt.flat_start, opt.precond_lr, opt.init_scale,
            opt.seed) == (0.9, False, 0.05, 500, 0.1, 1.0, 0)
    assert opt.layout_args == (25000, 2, None, True, 8192, True, 256)
    params = {"beta1": 0.5, "preconditioner_update_probability": 0.4, "update_prob_flat_start": -1000,
              "preconditioner_lr": 0.3, "preconditioner_init_scale": 3.0, "block_size": 8, "probe_seed": 5,
              "target_merged_dim_size": 16, "merge_small_dims": False, "max_size_triangular": 30,
              "min_ndim_triangular": 2, "partition_grads_into_blocks": True, "memory_save_mode": None}
    args = config_from_mapping({"optimizer": {"type": "Kron", "params": params}, "lr": 1e-3}).args
    opt = build_optimizer(model, args)
    assert isinstance(opt, LevanterKron)
    assert opt.layout((40, 24)).diag == [True, False]  # 40 > max_size_triangular 30
    assert opt.layout((40, 24)).block == (40, 8)  # not merged; the triangular dim cut into 8-blocks
    assert opt.param_groups[0]["lr"] == 1e-3
    assert (opt.beta1, opt.min_prob, opt.flat_start, opt.precond_lr, opt.init_scale, opt.seed) == (
        0.5, 0.4, -1000, 0.3, 3.0, 5)


def test_kron_layouts_refused_before_launch() -> None:
    from megatron.errors import ConfigError

    _finalize({"optimizer": {"type": "Kron"}})
    for keys in ({"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 3}}, {"model_parallel_size": 2},
                 {"model_parallel_size": 2, "zero_optimization": {"stage": 2}}):  # gathered (tests/distributed)
        _finalize({"optimizer": {"type": "Kron"}, **keys}, world=2)
    for keys, words in (({"zero_optimization": {"stage": 1}, "precision": "bfloat16"}, "use ZeRO stage 2 or 3"),
                        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                         "remove offload_optimizer"),
                        ({"pipe_parallel_size": 1, "precision": "bfloat16"}, "flat fp32 buffer"),
                        ({"gradient_clipping": 1.0, "optimizer": {"type": "Kron",
                                                                  "params": {"normalize_grads": True}}},
                         "set gradient_clipping: 0")):
        with pytest.raises(ConfigError, match=words):
            _finalize({"optimizer": {"type": "Kron"}, **keys})


def _levanter(tmp_path: Any, text: str) -> Any:
    from megatron.neox_arguments.dialects import split_argv
    from megatron.neox_arguments.loading import load_config

    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n" + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


# KronConfig (kron.py:90-112@9263f81e): beta1 0.9, weight_decay 0.1, max_grad_norm 1.0, normalize_grads false,
# preconditioner_update_probability 0.05, update_prob_flat_start 500, max_size_triangular 25000,
# min_ndim_triangular 2, memory_save_mode None, preconditioner_lr 0.1, preconditioner_init_scale 1.0,
# merge_small_dims true, target_merged_dim_size 8192, partition_grads_into_blocks true, block_size 256
@pytest.mark.parametrize(("text", "want"), [
    ("optimizer:\n  type: kron\n",
     dict(beta1=0.9, normalize_grads=False, min_prob=0.05, flat_start=500, precond_lr=0.1, init_scale=1.0,
          layout=(25000, 2, None, True, 8192, True, 256), wd=0.1, clip=1.0)),
    ("optimizer:\n  type: kron\n  beta1: 0.95\n  normalize_grads: true\n  preconditioner_update_probability: 0.1\n"
     "  update_prob_flat_start: 100\n  max_size_triangular: 4096\n  min_ndim_triangular: 1\n"
     "  memory_save_mode: one_diag\n  preconditioner_lr: 0.2\n  preconditioner_init_scale: 2.0\n"
     "  merge_small_dims: false\n  target_merged_dim_size: 1024\n  partition_grads_into_blocks: false\n"
     "  block_size: 128\n  weight_decay: 0.0\n",
     dict(beta1=0.95, normalize_grads=True, min_prob=0.1, flat_start=100, precond_lr=0.2, init_scale=2.0,
          layout=(4096, 1, "one_diag", False, 1024, False, 128), wd=0.0, clip=0.0)),
])
def test_levanter_yaml_builds_kron_with_levanters_defaults(tmp_path: Any, text: str, want: dict[str, Any]) -> None:
    """Levanter's ``optimizer: {type: kron}`` (and each of its fields) reaches Deepy's Kron; Levanter's FSDP stays
    ZeRO-3 (Kron gathers ZeRO's shards, as SOAP), and normalize_grads drops the global clip (kron.py:121)."""
    args = _levanter(tmp_path, text)
    opt = build_optimizer(torch.nn.Linear(8, 8), args)
    assert isinstance(opt, LevanterKron)
    assert (opt.beta1, opt.normalize_grads, opt.min_prob, opt.flat_start, opt.precond_lr, opt.init_scale) == (
        want["beta1"], want["normalize_grads"], want["min_prob"], want["flat_start"], want["precond_lr"],
        want["init_scale"])
    assert opt.layout_args == want["layout"]
    assert max(g["weight_decay"] for g in opt.param_groups) == want["wd"]
    assert args.gradient_clipping == want["clip"]
    assert args.sharding_strategy == "fsdp"


@pytest.mark.parametrize(("text", "words"), [
    ("optimizer:\n  type: adam\n  preconditioner_lr: 0.2\n", "only Levanter's kron optimizer has preconditioner_lr"),
    ("optimizer:\n  type: kron\n  shampoo_beta: 0.9\n", "only Levanter's soap optimizer has"),
    ("optimizer:\n  type: adam\n  block_size: 64\n", "only Levanter's soap and kron optimizers have block_size"),
])
def test_what_kron_does_not_have_is_refused(tmp_path: Any, text: str, words: str) -> None:
    from megatron.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        _levanter(tmp_path, text)
