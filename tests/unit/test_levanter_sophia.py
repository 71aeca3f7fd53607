"""Levanter's Sophia-H: Deepy's optimizer and Hessian probe against Levanter's formulas, resume, and its YAML.

The reference re-writes stanford-crfm/levanter 9263f81e's ``_sophia_gradient_transform`` (``src/levanter/optim/
sophia.py:318-388``), ``stochastic_hessian_diagonal`` (sophia.py:428-446) and the chain of ``SophiaHConfig.build``
(sophia.py:150-178: the transform, ``add_decayed_weights``, ``scale(-lr)``) in float64 NumPy, step by step as its code
reads, with the gradient and the full Hessian of the loss at the reference's own weights from
``torch.autograd.functional`` in float64 (not the probe's Hessian-vector product). Only the Gaussian vectors ``z`` are
shared: the test draws them by the rule the probe documents (a CPU generator seeded ``(rng_seed << 32) + index``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.engine.levanter_sophia import HessianProbe, LevanterSophiaH
from megatron.engine.optimizers import build_optimizer
from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import config_from_mapping, load_config

STEPS, LR, WD, SEED = 7, 0.05, 0.1, 3
X = torch.randn(8, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
Y = torch.randn(8, 3, generator=torch.Generator().manual_seed(12), dtype=torch.float64)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)  # weight decayed, bias not


def loss_of(weight: torch.Tensor, bias: torch.Tensor, step: int) -> torch.Tensor:
    """A non-quadratic loss (its Hessian changes with the weights), a different batch each step."""
    x, y = X.to(weight.dtype) * (1 + 0.1 * step), Y.to(weight.dtype)
    return ((torch.tanh(x @ weight.T + bias) - y) ** 2).mean()


def z_draw(shapes: list[tuple[int, ...]], index: int) -> list[np.ndarray]:
    generator = torch.Generator().manual_seed((SEED << 32) + index)
    return [torch.randn(shape, generator=generator, dtype=torch.float32).double().numpy() for shape in shapes]


def levanter_reference(start: list[np.ndarray], b1: float, b2: float, eps: float, gamma: float, clip: float | None,
                       interval: int) -> list[np.ndarray]:
    """Levanter's Sophia-H over STEPS steps; ``start`` = [weight, bias] (the weight decayed, the bias not)."""
    params = [p.copy() for p in start]
    shapes = [p.shape for p in params]
    sizes = [p.size for p in params]
    count, hessian_count = 0, 0
    mu = [np.zeros_like(p) for p in params]
    h = [np.zeros_like(p) for p in params]
    for step in range(STEPS):
        weight, bias = (torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params)
        grads = torch.autograd.grad(loss_of(weight, bias, step), [weight, bias])
        g = [x.numpy() for x in grads]
        mu = [(1 - b1) * gi + b1 * mi for gi, mi in zip(g, mu)]  # update_moment(updates, mu, b1, 1)
        mu_hat = [mi / (1 - b1 ** (count + 1)) for mi in mu]  # bias_correction(mu, b1, count + 1)
        updates = [m / np.maximum(gamma * hi, eps) for m, hi in zip(mu_hat, h)]
        if clip is not None:
            updates = [np.clip(u, -clip, clip) for u in updates]
        count += 1
        if count % interval == 0:  # update_hessian, at the params the update was computed at
            flat = torch.cat([torch.tensor(p, dtype=torch.float64).reshape(-1) for p in params])

            def flat_loss(v: torch.Tensor, step: int = step) -> torch.Tensor:
                w, b = torch.split(v, sizes)
                return loss_of(w.reshape(shapes[0]), b.reshape(shapes[1]), step)

            hessian = torch.autograd.functional.hessian(flat_loss, flat).numpy()
            z = z_draw(shapes, hessian_count)
            hz = np.split(hessian @ np.concatenate([zi.reshape(-1) for zi in z]), np.cumsum(sizes)[:-1])
            new = [hzi.reshape(zi.shape) * zi for hzi, zi in zip(hz, z)]  # grad * gaussian
            h = [(1 - b2) * ni + b2 * hi for ni, hi in zip(new, h)]  # update_moment(new_hess, h, b2, 1)
            hessian_count += 1
        decays = [WD, 0.0]
        updates = [u + d * p for u, d, p in zip(updates, decays, params)]  # add_decayed_weights
        params = [p + (-LR) * u for p, u in zip(params, updates)]  # scale(-lr), apply_updates
    return params


def train(model: Tiny, optimizer: torch.optim.Optimizer, probe: HessianProbe, steps: range) -> None:
    for step in steps:
        model.zero_grad()
        loss_of(model.linear.weight, model.linear.bias, step).backward()
        due = probe.due()
        if due:
            probe.measure(lambda: iter([loss_of(model.linear.weight, model.linear.bias, step)]))  # noqa: B023
        optimizer.step()
        if due:
            probe.deliver()


CASES = [((0.96, 0.99), 1e-12, 0.01, 1.0, 2), ((0.9, 0.8), 1e-6, 0.5, 0.2, 3), ((0.8, 0.9), 0.1, 1.0, None, 1)]


@pytest.mark.parametrize(("betas", "eps", "gamma", "clip", "interval"), CASES)
def test_update_over_steps_equals_levanters_formula(betas: tuple[float, float], eps: float, gamma: float,
                                                    clip: float | None, interval: int) -> None:
    model = Tiny()
    start = [p.detach().double().numpy().copy() for p in (model.linear.weight, model.linear.bias)]
    params = {"lr": LR, "betas": list(betas), "eps": eps, "gamma": gamma, "clip_threshold": clip,
              "update_interval": interval, "rng_seed": SEED}
    cfg = config_from_mapping({"optimizer": {"type": "SophiaH", "params": params}, "weight_decay": WD}).args
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, LevanterSophiaH)
    train(model, optimizer, HessianProbe(model, optimizer, SEED), range(STEPS))
    expected = levanter_reference(start, *betas, eps, gamma, clip, interval)
    for got, want, initial in zip((model.linear.weight, model.linear.bias), expected, start):
        np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=0, atol=1e-6)
        assert not np.allclose(want, initial, atol=1e-3)  # the steps moved it: the check can fail
    h = optimizer.state[model.linear.weight]["h"]
    assert float(h.abs().max()) > 0  # the Hessian estimates reached the update


def test_the_estimate_changes_the_update() -> None:
    """Without the probe (h stays 0) the same steps end elsewhere: the comparison above sees the Hessian."""
    model = Tiny()
    start = [p.detach().double().numpy().copy() for p in (model.linear.weight, model.linear.bias)]
    expected = levanter_reference(start, 0.9, 0.8, 1e-6, 0.5, 0.2, 3)
    optimizer = LevanterSophiaH(model.parameters(), lr=LR, betas=(0.9, 0.8), eps=1e-6, gamma=0.5, clip_threshold=0.2,
                                update_interval=3, weight_decay=0.0)
    for step in range(STEPS):
        model.zero_grad()
        loss_of(model.linear.weight, model.linear.bias, step).backward()
        optimizer.step()
    assert not np.allclose(model.linear.weight.detach().double().numpy(), expected[0], atol=1e-4)


def test_resume_from_the_state_dict_is_exact() -> None:
    def fresh() -> tuple[Tiny, LevanterSophiaH, HessianProbe]:
        model = Tiny()
        opt = LevanterSophiaH(model.parameters(), lr=LR, betas=(0.9, 0.8), eps=1e-6, gamma=0.5, clip_threshold=0.2,
                              update_interval=2, weight_decay=WD)
        return model, opt, HessianProbe(model, opt, SEED)

    straight, opt, probe = fresh()
    train(straight, opt, probe, range(STEPS))
    first, opt, probe = fresh()
    train(first, opt, probe, range(4))  # the 4th step measured an estimate the 5th folds in: it is in the state
    saved, weights = opt.state_dict(), {k: v.detach().clone() for k, v in first.state_dict().items()}
    resumed, opt, probe = fresh()
    resumed.load_state_dict(weights)
    opt.load_state_dict(saved)
    train(resumed, opt, probe, range(4, STEPS))
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a.detach(), b.detach())


MODEL = "model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"


def load(tmp_path: Path, text: str) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(MODEL + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


# SophiaHConfig (sophia.py:127-137,200-203@9263f81e): beta1 0.96, beta2 0.99, epsilon 1e-12, clip_threshold 1.0,
# rng_seed 0, gamma 0.01 (GAMMA_SOPHIA_H), weight_decay 0.1; HessianOptConfig.update_interval 10 (config.py:397-399);
# OptimizerConfig's learning_rate 6e-4. No max_grad_norm: its chain clips no gradient (sophia.py:150-178).
@pytest.mark.parametrize(("text", "want"), [
    ("optimizer:\n  type: sophia-h\n", dict(betas=(0.96, 0.99), eps=1e-12, gamma=0.01, clip_threshold=1.0,
                                            update_interval=10, weight_decay=0.1, lr=6e-4)),
    ("optimizer:\n  type: sophia-h\n  learning_rate: 2.0e-4\n  weight_decay: 0.2\n  gamma: 0.005\n  beta1: 0.9\n"
     "  epsilon: 1.0e-8\n  clip_threshold: 0.5\n  update_interval: 4\n  rng_seed: 7\n",
     dict(betas=(0.9, 0.99), eps=1e-8, gamma=0.005, clip_threshold=0.5, update_interval=4, weight_decay=0.2, lr=2e-4)),
])
def test_levanter_yaml_builds_sophia_h_with_levanters_defaults(tmp_path: Path, text: str, want: dict[str, Any]) -> None:
    args = load(tmp_path, text)
    optimizer = build_optimizer(Tiny(), args)
    assert type(optimizer) is LevanterSophiaH
    for key in ("betas", "eps", "gamma", "clip_threshold", "update_interval", "lr"):
        assert optimizer.defaults[key] == want[key], key
    assert optimizer.param_groups[0]["weight_decay"] == want["weight_decay"]
    assert args.gradient_clipping == 0.0
    assert args.optimizer_params["rng_seed"] == (7 if "rng_seed" in text else 0)


@pytest.mark.parametrize(("text", "words"), [
    ("optimizer:\n  type: sophia-h\n  max_grad_norm: 1.0\n", "sophia-h optimizer has no max_grad_norm"),
    ("optimizer:\n  type: adam\n  gamma: 0.01\n", "only Levanter's sophia-h optimizer has gamma"),
    ("optimizer:\n  type: sophia-g\n", "Sophia-G"),
])
def test_what_sophia_h_does_not_have_is_refused(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, text)


LEVANTER_CONFIGS = Path("/tmp/h3_lev/config")
SOPHIA_FILES = ["gpt2_1536_sophiah.yaml", "gpt2_large_sophia_h.yaml", "gpt2_small_fast_sophia_h.yaml",
                "gpt2_small_fast_sophiah.yaml", "gpt2_small_sophiah.yaml"]


LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, use_dummy_dataset=True,
              tokenizer_type="CharLevelTokenizer", pipe_parallel_size=0, hidden_dropout=0.0, attention_dropout=0.0,
              checkpoint_activations=True)



@pytest.mark.parametrize("precision", ["fp32", "bfloat16"])
def test_the_trainers_step_feeds_the_estimate_to_the_engines_optimizer(one_rank: Any, precision: str) -> None:
    """build_engine installs the probe for SophiaH and the trainer's own step (``train_step``: 2 micro-batches, DeepSpeed's
    activation checkpointing) measures and delivers it: in fp32 to the model's parameters' state, in bfloat16 (what
    Levanter's mp: p=f32,c=bfloat16 maps to) to the fp32 masters DeepSpeed's unfused mixed-precision wrapper steps."""
    from megatron.config_rules import Device
    from megatron.engine.build import build_engine
    from megatron.engine.levanter_sophia import base_sophia
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.step import train_step

    params = {"lr": 0.01, "gamma": 0.5, "update_interval": 2}
    keys = {**LAUNCH, "optimizer": {"type": "SophiaH", "params": params}, "lr": None, "precision": precision}
    run = RunConfig.from_resolved(finalize(config_from_mapping(keys), 1, device=Device(cuda=False, fp16_supported=False)))
    eng = build_engine(run, run.model.with_vocab(64), 4)
    assert eng.hessian_probe is not None
    sophia = base_sophia(eng.optimizer)
    assert sophia is not None
    gen = torch.Generator().manual_seed(1)
    batches = iter([{"text": torch.randint(0, 64, (1, 9), generator=gen)} for _ in range(6)])
    norms = []
    for _ in range(3):
        train_step(eng, batches, torch.device("cpu"))
        norms.append(sum(float(s["h"].abs().sum()) for s in sophia.state.values()))
    # the estimate measured in step 2 is folded into h at the start of step 3
    assert norms[0] == norms[1] == 0.0 and norms[2] > 0
    estimates = [s["hessian_estimate"] for s in sophia.state.values()]
    assert all(e.dtype == torch.float32 for e in estimates) and sum(float(e.abs().sum()) for e in estimates) > 0


def test_sophia_h_layouts_before_launch() -> None:
    """Tensor (and sequence) parallelism and ZeRO-3 run (tests/distributed/test_levanter_whole_tensor_tp.py: the
    estimate at tp 2 equals tp 1; test_levanter_sophia_zero.py: ZeRO-3 equals ZeRO-0); context parallelism and
    pipelines are refused by name."""
    from megatron.config_rules import Device
    from megatron.neox_arguments.derived import finalize

    launch = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
                  train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                  pipe_parallel_size=0, optimizer={"type": "SophiaH"}, gradient_clipping=0.0)
    cpu = Device(cuda=False, fp16_supported=False)
    finalize(config_from_mapping({**launch, "model_parallel_size": 2, "zero_optimization": {"stage": 1}}), 2,
             device=cpu)
    finalize(config_from_mapping({**launch, "zero_optimization": {"stage": 3}}), 2, device=cpu)
    finalize(config_from_mapping({**launch, "model_parallel_size": 2, "sequence_parallel": True}), 2, device=cpu)
    for keys, words in (({"context_parallel_size": 2}, "context-parallel attention"),
                        ({"pipe_parallel_size": 1}, "pipe_parallel_size: 0")):
        with pytest.raises(ConfigError, match=words):
            finalize(config_from_mapping({**launch, **keys}), 2, device=cpu)
