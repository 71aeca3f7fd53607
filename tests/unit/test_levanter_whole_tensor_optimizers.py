"""Levanter's Muon, Scion, MARS and Cautious: Deepy's optimizers against Levanter's formulas, and its YAML.

The references below re-write stanford-crfm/levanter 9263f81e's optax chains in float64 NumPy, step by step as its
code reads (``src/levanter/optim/muon.py:48-202``, ``scion.py:40-178``, ``mars.py:32-127``, ``cautious.py:39-130``,
optax's ``clip_by_global_norm``/``scale_by_adam``/``add_decayed_weights``/``scale``), with Levanter's masks written
out here (a linear layer's weight takes Muon/Scion, embeddings, the output layer, norms and biases AdamW/signum;
Levanter's default decay mask; a weight's leaf stacked over the layers), independent of the torch code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from megatron.config_rules import Device
from megatron.engine.levanter_whole_tensor_optim import LevanterCautious, LevanterMars, LevanterMuon, LevanterScion
from megatron.engine.optimizers import build_optimizer
from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import config_from_mapping, load_config

STEPS = 4
WD = 0.1
Arrays = dict[str, np.ndarray]


def model() -> GPTModel:
    return GPTModel(GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                              padded_vocab_size=16, seed=3, no_weight_tying=True))


# --- Levanter's masks, from its code -----------------------------------------------------------------------------
def linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """create_mask (muon.py:91-111, scion.py:78-95): a Linear's weight, not Embedding nor lm_head."""
    return len(shape) == 2 and not any(k in name for k in ("embeddings", "output_layer"))


def decayed(name: str, shape: tuple[int, ...]) -> bool:
    """build_weight_decay_mask's default (config.py:148-160): no norms, embeddings, biases."""
    return len(shape) == 2 and "embeddings" not in name


def stack(name: str) -> str:
    """Stacked blocks (gpt2.py:253-259): one leaf per weight over every layer."""
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def clip_by_global_norm(grads: Arrays, max_norm: float | None) -> Arrays:
    if not max_norm:
        return grads
    norm = np.sqrt(sum(float((g**2).sum()) for g in grads.values()))
    return grads if norm < max_norm else {n: g / norm * max_norm for n, g in grads.items()}


def newton_schulz(x: np.ndarray, steps: int, eps: float) -> np.ndarray:
    """zeropower_via_newtonschulz5 (muon.py:171-202)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = x / (np.linalg.norm(x) + eps)
    flip = x.shape[0] > x.shape[1]
    x = x.T if flip else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if flip else x


class Adam:
    """optax.scale_by_adam (eps_root 0)."""

    def __init__(self, b1: float, b2: float, eps: float) -> None:
        self.b1, self.b2, self.eps, self.count = b1, b2, eps, 0
        self.mu: Arrays = {}
        self.nu: Arrays = {}

    def __call__(self, grads: Arrays) -> Arrays:
        self.count += 1
        out = {}
        for n, g in grads.items():
            self.mu[n] = self.b1 * self.mu.get(n, np.zeros_like(g)) + (1 - self.b1) * g
            self.nu[n] = self.b2 * self.nu.get(n, np.zeros_like(g)) + (1 - self.b2) * g**2
            mu_hat = self.mu[n] / (1 - self.b1**self.count)
            nu_hat = self.nu[n] / (1 - self.b2**self.count)
            out[n] = mu_hat / (np.sqrt(nu_hat) + self.eps)
        return out


def apply(p: Arrays, updates: Arrays, lr: float) -> None:
    """add_decayed_weights(WD, mask) then scale(-lr)."""
    for n, u in updates.items():
        p[n] = p[n] + (-lr) * (u + (WD * p[n] if decayed(n, p[n].shape) else 0.0))


def muon_reference(p: Arrays, steps: list[Arrays], lr: float | list[float], adam_lr: float | list[float],
                   momentum: float = 0.95, nesterov: bool = True, backend_steps: int = 5, kimi: bool = False,
                   max_norm: float = 1.0) -> Arrays:
    """``lr``/``adam_lr``: the peaks, or the schedule's value at each step (``inject_hyperparams``)."""
    adam, buf = Adam(0.9, 0.95, 1e-8), {n: np.zeros_like(v) for n, v in p.items()}
    for i, grads in enumerate(steps):
        rate = lr[i] if isinstance(lr, list) else lr
        rest = {n: g for n, g in grads.items() if not linear_weight(n, g.shape)}
        apply(p, adam(clip_by_global_norm(rest, max_norm)), adam_lr[i] if isinstance(adam_lr, list) else adam_lr)
        updates = {}
        for n, g in grads.items():
            if n in rest:
                continue
            buf[n] = momentum * buf[n] + g
            v = momentum * buf[n] + g if nesterov else buf[n]
            o = newton_schulz(v, backend_steps, 1e-8)
            rows, cols = o.shape
            updates[n] = o * (0.2 * np.sqrt(max(rows, cols)) if kimi else np.sqrt(max(1, rows / cols)))
        apply(p, updates, rate)
    return p


def scion_reference(p: Arrays, steps: list[Arrays], lr: float, to_signum: float = 0.25, momentum: float = 0.95,
                    beta1: float = 0.9, backend_steps: int = 10, max_norm: float = 1.0) -> Arrays:
    buf = {n: np.zeros_like(v) for n, v in p.items()}
    for grads in steps:
        rest = clip_by_global_norm({n: g for n, g in grads.items() if not linear_weight(n, g.shape)}, max_norm)
        signum = {}
        for n, g in rest.items():
            buf[n] = beta1 * buf[n] + (1 - beta1) * g
            signum[n] = np.sign(buf[n])
        apply(p, signum, lr * to_signum)
        updates = {}
        for n, g in grads.items():
            if n in rest:
                continue
            buf[n] = momentum * buf[n] + (1 - momentum) * g
            o = newton_schulz(buf[n], backend_steps, 1e-8)
            updates[n] = o * np.sqrt(max(1, o.shape[0] / o.shape[1]))
        apply(p, updates, lr)
    return p


def mars_reference(p: Arrays, steps: list[Arrays], lr: float, b1: float = 0.95, b2: float = 0.99,
                   gamma: float = 0.025, eps: float = 1e-8, max_norm: float = 1.0) -> Arrays:
    mu = {n: np.zeros_like(v) for n, v in p.items()}
    nu, mog = dict(mu), dict(mu)
    for count, grads in enumerate(steps, 1):
        c = {n: g + (gamma * b1 / (1 - b1)) * (g - mog[n]) for n, g in grads.items()}
        norm = np.sqrt(sum(float((v**2).sum()) for v in c.values()))
        c = {n: v * min(1.0, max_norm / (norm + 1e-6)) for n, v in c.items()}
        updates = {}
        for n, v in c.items():
            mu[n] = (1 - b1) * v + b1 * mu[n]
            nu[n] = (1 - b2) * v**2 + b2 * nu[n]
            updates[n] = (mu[n] / (1 - b1**count)) / (np.sqrt(nu[n] / (1 - b2**count)) + eps)
        mog = dict(grads)
        apply(p, updates, lr)
    return p


def cautious_reference(p: Arrays, steps: list[Arrays], lr: float, b1: float = 0.95, b2: float = 0.95,
                       eps: float = 1e-8) -> Arrays:
    adam = Adam(b1, b2, eps)
    for grads in steps:
        u = adam(grads)
        mask = {n: (grads[n] * u[n]) > 0 for n in grads}
        leaves: dict[str, list[np.ndarray]] = {}
        for n, m in mask.items():
            leaves.setdefault(stack(n), []).append(m)
        mean = {s: np.concatenate([m.ravel() for m in ms]).mean() for s, ms in leaves.items()}
        apply(p, {n: u[n] * mask[n] / (mean[stack(n)] + eps) for n in grads}, lr)
    return p


CASES: list[tuple[str, dict[str, Any], Any, dict[str, Any]]] = [
    ("Muon", {"lr": 0.02, "adam_lr": 0.005}, muon_reference, {"lr": 0.02, "adam_lr": 0.005}),
    ("Muon", {"lr": 0.01, "adam_lr": 0.002, "nesterov": False, "momentum": 0.8, "backend_steps": 3,
              "use_kimi_scaling": True, "inner_max_grad_norm": 50.0},
     muon_reference, {"lr": 0.01, "adam_lr": 0.002, "nesterov": False, "momentum": 0.8, "backend_steps": 3,
                      "kimi": True, "max_norm": 50.0}),
    ("Scion", {"lr": 0.02}, scion_reference, {"lr": 0.02}),
    ("Scion", {"lr": 0.01, "scion_to_signum_lr": 0.5, "momentum": 0.9, "beta1": 0.8, "backend_steps": 5},
     scion_reference, {"lr": 0.01, "to_signum": 0.5, "momentum": 0.9, "beta1": 0.8, "backend_steps": 5}),
    ("MARS", {"lr": 0.01}, mars_reference, {"lr": 0.01}),
    ("MARS", {"lr": 0.01, "betas": [0.9, 0.95], "gamma": 0.1, "eps": 1e-3, "inner_max_grad_norm": 100.0},
     mars_reference, {"lr": 0.01, "b1": 0.9, "b2": 0.95, "gamma": 0.1, "eps": 1e-3, "max_norm": 100.0}),
    ("Cautious", {"lr": 0.01}, cautious_reference, {"lr": 0.01}),
    ("Cautious", {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-3}, cautious_reference,
     {"lr": 0.01, "b1": 0.9, "b2": 0.99, "eps": 1e-3}),
]


def gradients(net: torch.nn.Module, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) * (0.5 + i) for n, p in net.named_parameters()}
            for i in range(STEPS)]


def built(net: torch.nn.Module, kind: str, params: dict[str, Any]) -> torch.optim.Optimizer:
    cfg = config_from_mapping({"optimizer": {"type": kind, "params": params}, "weight_decay": WD,
                               "weight_decay_embeddings": False}).args
    return build_optimizer(net, cfg)


@pytest.mark.parametrize(("kind", "params", "reference", "kwargs"), CASES)
def test_update_over_steps_equals_levanters_formula(kind: str, params: dict[str, Any], reference: Any,
                                                    kwargs: dict[str, Any]) -> None:
    net = model()
    start = {n: p.detach().double().numpy().copy() for n, p in net.named_parameters()}
    grads = gradients(net, 1)
    optimizer = built(net, kind, params)
    for step in grads:
        for name, p in net.named_parameters():
            p.grad = step[name].clone()
        optimizer.step()
    expected = reference(dict(start), [{n: g.double().numpy() for n, g in s.items()} for s in grads], **kwargs)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)
        assert not np.allclose(expected[name], start[name], atol=1e-4), name  # it moved: the check can fail


@pytest.mark.parametrize("kind", ["Muon", "Scion", "MARS", "Cautious"])
def test_resume_from_the_state_dict_is_exact(kind: str) -> None:
    grads = gradients(model(), 7) * 2

    def run(steps: range, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for i in steps:
            for name, p in net.named_parameters():
                p.grad = grads[i][name].clone()
            opt.step()

    straight = model()
    run(range(6), straight, built(straight, kind, {"lr": 0.01}))
    first = model()
    opt = built(first, kind, {"lr": 0.01})
    run(range(3), first, opt)
    saved = opt.state_dict()
    resumed = model()
    resumed.load_state_dict(first.state_dict())
    opt = built(resumed, kind, {"lr": 0.01})
    opt.load_state_dict(saved)
    run(range(3, 6), resumed, opt)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_torch_muon_is_not_levanters() -> None:
    """Why torch.optim.Muon (torch 2.13) is not used: its Newton-Schulz runs in bfloat16 and its momentum is damped;
    on one fp32 matrix it misses Levanter's update by far more than 1e-6."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(8, 16, generator=g)
    ours = torch.nn.Parameter(torch.zeros(8, 16))
    theirs = torch.nn.Parameter(torch.zeros(8, 16))
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    LevanterMuon([{"params": [ours], "role": "muon"}], lr=0.02).step()
    torch.optim.Muon([theirs], lr=0.02, weight_decay=0.0).step()
    want = -0.02 * newton_schulz((1 + 0.95) * grad.double().numpy(), 5, 1e-8)
    np.testing.assert_allclose(ours.detach().double().numpy(), want, rtol=0, atol=1e-6)
    assert float((theirs.detach() - ours.detach()).abs().max()) > 1e-4


MODEL = "model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"


def load(tmp_path: Path, text: str) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(MODEL + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


# MuonConfig (muon.py:33-46@9263f81e), ScionConfig (scion.py:31-38), MarsConfig (mars.py:25-30), CautiousConfig
# (cautious.py:25-30), OptimizerConfig's learning_rate 6e-4 and weight_decay 0.1 (config.py:112-113)
@pytest.mark.parametrize(("text", "cls", "defaults", "decay", "clip"), [
    ("type: muon\n", LevanterMuon, {"momentum": 0.95, "nesterov": True, "backend_steps": 5, "betas": (0.9, 0.95),
                                    "eps": 1e-8, "muon_epsilon": 1e-8, "use_kimi_scaling": False}, 0.0, 0.0),
    ("type: scion\n", LevanterScion, {"momentum": 0.95, "backend_steps": 10, "beta1": 0.9, "scion_epsilon": 1e-8},
     0.0, 0.0),
    ("type: mars\n", LevanterMars, {"betas": (0.95, 0.99), "gamma": 0.025, "eps": 1e-8}, 0.1, 0.0),
    ("type: cautious\n  gamma: 0.5\n", LevanterCautious, {"betas": (0.95, 0.95), "eps": 1e-8}, 0.1, 1.0),
    ("type: muon\n  lr: 0.02\n  adam_lr: 1.0e-3\n  momentum: 0.9\n  nesterov: false\n  weight_decay: 0.05\n"
     "  max_grad_norm: 0.5\n", LevanterMuon, {"momentum": 0.9, "nesterov": False}, 0.05, 0.0),
])
def test_levanter_yaml_builds_the_optimizer_with_levanters_defaults(
        tmp_path: Path, text: str, cls: type, defaults: dict[str, Any], decay: float, clip: float) -> None:
    args = load(tmp_path, "optimizer:\n  " + text)
    optimizer = build_optimizer(model(), args)
    assert type(optimizer) is cls
    assert {k: optimizer.defaults[k] for k in defaults} == defaults
    assert optimizer.defaults["lr"] == 6e-4
    # MARS keeps one group, each parameter's decay in its ``decays`` (ZeRO steps a group at a time)
    assert {d for g in optimizer.param_groups for d in g.get("decays", [g["weight_decay"]])} == {decay, 0.0}
    assert args.gradient_clipping == clip
    # Muon and Scion gather their matrices from ZeRO's partitions, MARS and Cautious add their sums over them:
    # Levanter's fsdp is ZeRO-3
    assert args.sharding_strategy == "fsdp"
    if cls is LevanterMuon:  # the AdamW half at adam_lr, on lr's schedule; Levanter's max_grad_norm inside
        adam = [g["lr_scale"] for g in optimizer.param_groups if g["role"] == "adamw"]
        assert adam == [pytest.approx((1e-3 if "adam_lr" in text else 6e-4) / 6e-4)] * 2
        assert cast(LevanterMuon, optimizer).max_grad_norm == (0.5 if "max_grad_norm" in text else 1.0)
    if cls is LevanterScion:
        assert {g["lr_scale"] for g in optimizer.param_groups if g["role"] == "signum"} == {0.25}


def test_levanters_gpt2_small_fast_muon_yaml_loads(tmp_path: Path) -> None:
    """config/gpt2_small_fast_muon.yaml@9263f81e with its data swapped (its trainer/tracker lines as they are)."""
    args = load(tmp_path, "  seq_len: 64\ntrainer:\n  mp: p=f32,c=bfloat16\n  model_axis_size: 1\n"
                "  per_device_parallelism: -1\n  train_batch_size: 256\n  num_train_steps: 20000\n"
                "optimizer:\n  type: muon\n  learning_rate: 1E-2\n  weight_decay: 0.05\n")
    assert args.optimizer.type == "Muon" and args.lr == 0.01 and args.weight_decay == 0.05
    assert args.optimizer.params.adam_lr == 6e-4 and args.gradient_clipping == 0.0


@pytest.mark.parametrize(("text", "words"), [
    ("type: mars\n  adam_lr: 0.1\n", "mars optimizer has no adam_lr"),
    ("type: adam\n  lr: 0.1\n", "only Levanter's muon, scion and mini optimizers have lr"),
    ("type: scion\n  epsilon: 1.0e-3\n", "scion optimizer has no epsilon"),
])
def test_fields_the_type_does_not_have_are_refused(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, "optimizer:\n  " + text)


LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0, gradient_clipping=0.0)


def refused(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        finalize(config_from_mapping({**LAUNCH, **keys}), 1, device=Device(cuda=False, fp16_supported=False))
    return info.value.message


@pytest.mark.parametrize("kind", ["Muon", "Scion", "MARS", "Cautious"])
def test_whole_tensor_layouts_are_refused_before_launch(kind: str) -> None:
    block = {"type": kind}
    # all four run under ZeRO 1-3 (Muon, Scion: tests/distributed/test_levanter_optimizers_zero.py; MARS, Cautious:
    # tests/distributed/test_levanter_whole_tensor_tp.py)
    for stage in (1, 2, 3):
        finalize(config_from_mapping({**LAUNCH, "optimizer": block, "zero_optimization": {"stage": stage}}), 1,
                 device=Device(cuda=False, fp16_supported=False))
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert "remove offload_optimizer" in refused(optimizer=block, zero_optimization=offload)
    assert "BF16_Optimizer" in refused(optimizer=block, zero_optimization={"stage": 1}, precision="bfloat16")
    if kind == "MARS":  # its one group cannot hold muP's per-width rates, and ZeRO steps a group at a time
        assert "muP's per-width" in refused(optimizer=block, zero_optimization={"stage": 2}, use_mup=True)
    assert "BF16_Optimizer" in refused(optimizer=block, pipe_parallel_size=1, precision="bfloat16")
    if kind != "Cautious":
        assert "set gradient_clipping: 0" in refused(optimizer=block, gradient_clipping=1.0)
    finalize(config_from_mapping({**LAUNCH, "optimizer": block}), 1, device=Device(cuda=False, fp16_supported=False))



@pytest.mark.parametrize("stage", [0, 2])
def test_muon_through_the_engine_and_schedule_equals_levanters(one_rank: Any, stage: int) -> None:
    """build_engine (a real DeepSpeed engine, Deepy's cosine schedule with warmup): three steps of Muon equal the
    reference at the rates the schedule gives, the AdamW half at adam_lr / lr of the Muon half's at every step, as
    Levanter's two schedules (lr_scheduler(override_lr=adam_lr), muon.py:52-53) are. At ZeRO stage 2 build_engine's
    own hooks (the partitions' layout, the clip's norm before the step) run it (its dp 2 checks are
    tests/distributed/test_levanter_optimizers_zero.py's)."""
    from deepspeed.utils import safe_get_full_grad

    from megatron.engine.build import build_engine
    from megatron.model import lm_loss
    from megatron.neox_arguments.run_config import RunConfig

    keys = {**LAUNCH, "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.005}}, "lr": None,
            "warmup": 0.5, "lr_decay_style": "cosine", "weight_decay": WD, "weight_decay_embeddings": False,
            "precision": "fp32", "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "zero_optimization": {"stage": stage}}
    run = RunConfig.from_resolved(finalize(config_from_mapping(keys), 1, device=Device(cuda=False,
                                                                                           fp16_supported=False)))
    eng = build_engine(run, run.model.with_vocab(64), 4)
    assert eng.engine.zero_optimization_stage() == stage
    module = eng.engine.module
    start = {n: p.detach().double().numpy().copy() for n, p in module.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    grads, muon_lr, adam_lr = [], [], []
    for _ in range(3):
        tokens, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
        eng.engine.backward(lm_loss(eng.engine(tokens), labels))
        grads.append({n: safe_get_full_grad(p).detach().double().numpy().copy()
                      for n, p in module.named_parameters()})
        rates = {g["role"]: g["lr"] for g in eng.optimizer.param_groups}
        muon_lr.append(rates["muon"])
        adam_lr.append(rates["adamw"])
        eng.engine.step()
    assert len(set(muon_lr)) > 1  # the schedule moved the rate
    assert adam_lr == [pytest.approx(r * 0.005 / 0.02) for r in muon_lr]
    expected = muon_reference(dict(start), grads, muon_lr, adam_lr)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_bf16_without_a_pipeline_module_steps_whole_weights(one_rank: Any) -> None:
    """precision bfloat16 at pipe_parallel_size 0 (what Levanter's mp: p=f32,c=bfloat16 maps to): DeepSpeed's
    mixed-precision wrapper hands Muon each fp32 master weight whole, so it trains; with a pipeline module it would
    hand it flat buffers (refused above)."""
    from megatron.engine.build import build_engine
    from megatron.model import lm_loss
    from megatron.neox_arguments.run_config import RunConfig

    keys = {**LAUNCH, "optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "lr": None, "precision": "bfloat16"}
    run = RunConfig.from_resolved(finalize(config_from_mapping(keys), 1, device=Device(cuda=False,
                                                                                           fp16_supported=False)))
    eng = build_engine(run, run.model.with_vocab(64), 4)
    shapes = {g["role"]: {len(p.shape) for p in g["params"]} for g in eng.engine.optimizer.param_groups}
    assert shapes["muon"] == {2}
    before = {n: p.detach().float().clone() for n, p in eng.engine.module.named_parameters()}
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    eng.engine.backward(lm_loss(eng.engine(tokens), tokens))
    eng.engine.step()
    moved = [n for n, p in eng.engine.module.named_parameters() if not torch.equal(p.detach().float(), before[n])]
    assert "layers.0.attention.query_key_value.weight" in moved


@pytest.mark.parametrize("kind", ["Muon", "Scion"])
def test_sections_are_orthogonalised_apart_as_levanters_llama(kind: str) -> None:
    """orthogonalise_sections: the fused [q; k; v] and [gate; up] rows take Newton-Schulz (and the out/in scale)
    section by section, as Levanter's Llama keeps q_proj, k_proj, v_proj, gate_proj, up_proj (attention.py:1473-1485,
    llama.py:264@9263f81e); other matrices whole. One step from zero momentum, against the float64 formula."""
    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_kv_heads=2, seq_length=4,
                    padded_vocab_size=16, seed=3, pos_emb="rotary", activation="swiglu", norm="rmsnorm",
                    intermediate_size=24, no_weight_tying=True, use_bias_in_attn_linear=False)
    steps, lr = 5, 0.02
    params = {"lr": lr, "backend_steps": steps, "orthogonalise_sections": True}
    if kind == "Scion":
        params["scion_to_signum_lr"] = 0.0
    net = GPTModel(cfg)
    start = {n: p.detach().double().numpy().copy() for n, p in net.named_parameters()}
    args = config_from_mapping({"optimizer": {"type": kind, "params": params}, "weight_decay": 0.0}).args
    optimizer = build_optimizer(net, args)
    gen = torch.Generator().manual_seed(1)
    grads = {}
    for n, p in net.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        grads[n] = p.grad.double().numpy().copy()
    optimizer.step()
    ffn = dict(net.named_parameters())["layers.0.mlp.dense_h_to_4h.weight"].shape[0] // 2  # SwiGLU: [gate; up]
    sections = {"query_key_value": [4 * 4, 2 * 4, 2 * 4], "dense_h_to_4h": [ffn, ffn]}  # q: 4 heads, k/v: 2, of 4
    checked = 0
    for name, p in net.named_parameters():
        if not linear_weight(name, tuple(p.shape)):
            continue
        direction = (1 + 0.95) * grads[name] if kind == "Muon" else (1 - 0.95) * grads[name]  # nesterov / damped
        rows = next((s for key, s in sections.items() if key in name), [p.shape[0]])
        parts = np.split(direction, np.cumsum(rows)[:-1], axis=0)
        update = np.concatenate([newton_schulz(part, steps, 1e-8) * np.sqrt(max(1.0, part.shape[0] / part.shape[1]))
                                 for part in parts])
        np.testing.assert_allclose(p.detach().double().numpy(), start[name] - lr * update, rtol=0, atol=1e-6)
        if len(rows) > 1:  # the fused matrix whole would move it otherwise
            scale = np.sqrt(max(1.0, direction.shape[0] / direction.shape[1]))
            whole_update = newton_schulz(direction, steps, 1e-8) * scale
            assert np.abs(whole_update - update).max() > 1e-3
            checked += 1
    assert checked == 2


def test_levanter_llama_orthogonalises_sections_and_gpt2_does_not(tmp_path: Path) -> None:
    """The dialect sets orthogonalise_sections from model.type: Levanter's GPT-2 fuses c_attn (gpt2.py:172), every
    other type keeps q/k/v and gate/up apart."""
    for model_type, apart in (("gpt2", False), ("llama", True)):
        (tmp_path / "tokenizer.json").write_text("{}")
        config = tmp_path / "run.yaml"
        kv = "  num_kv_heads: 2\n" if model_type == "llama" else ""
        config.write_text(MODEL.replace("type: gpt2", f"type: {model_type}") + kv + "optimizer:\n  type: muon\n")
        _, parsed = split_argv(["--config_path", str(config)])
        args = load_config([], (), None, parsed).args
        assert args.optimizer_params["orthogonalise_sections"] is apart, model_type
