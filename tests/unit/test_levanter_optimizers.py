"""Levanter's ADOPT and RMSProp-with-momentum: Deepy's optimizers against Levanter's formulas, and its YAML.

The references below re-write stanford-crfm/levanter 9263f81e's optax chains in float64 NumPy, step by step as
its code reads (``src/levanter/optim/adopt.py:40-52,99-129``, ``rmsprop.py:36-51,98-134``, optax's
``tree_bias_correction``/``tree_update_moment``/``add_decayed_weights``), independent of the torch code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.engine.levanter_optim import LevanterAdopt, LevanterRMSPropMomentum, LevanterOptimizer
from megatron.engine.optimizers import build_optimizer
from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import config_from_mapping, load_config

STEPS = 6
LR, WD = 0.01, 0.1


def adopt_reference(p: np.ndarray, grads: list[np.ndarray], decay: float, b1: float, b2: float,
                    eps: float) -> np.ndarray:
    """``scale_by_adopt`` + ``add_decayed_weights`` + ``scale(-lr)``."""
    count, mu, nu = 0, np.zeros_like(p), np.zeros_like(p)
    for g in grads:
        with np.errstate(divide="ignore", invalid="ignore"):  # count 0: the bias correction divides by 0,
            nu_hat = nu / (1 - b2**count)                     # and lax.cond takes the zero branch
        adam_updates = np.zeros_like(g) if count == 0 else g / (np.sqrt(nu_hat + 0.0) + eps)
        mu = (1 - b1) * adam_updates + b1 * mu  # tree_update_moment(..., order 1)
        nu = (1 - b2) * g**2 + b2 * nu  # tree_update_moment_per_elem_norm(..., order 2)
        count += 1
        mu_hat = mu / (1 - b1**count)
        update = mu_hat + decay * p  # add_decayed_weights
        p = p + (-LR) * update  # scale(-learning_rate), apply_updates
    return p


def rmsprop_reference(p: np.ndarray, grads: list[np.ndarray], decay: float, b1: float, b2: float,
                      eps: float) -> np.ndarray:
    """``scale_by_rmsprop_momentum`` + ``add_decayed_weights`` + ``scale(-lr)``."""
    count, mean_square, momentum = 0, np.zeros_like(p), np.zeros_like(p)
    for g in grads:
        count += 1
        mean_square = b2 * mean_square + (1.0 - b2) * g**2
        mean_square_hat = mean_square / (1 - b2**count)
        scaled = g / (np.sqrt(mean_square_hat) + eps)
        momentum = b1 * momentum + (1 - b1) * scaled
        update = momentum / (1 - b1**count) + decay * p
        p = p + (-LR) * update
    return p


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)  # weight decayed, bias not


CASES = [("ADOPT", adopt_reference, (0.9, 0.95), 1e-6), ("RMSPropMomentum", rmsprop_reference, (0.9, 0.99), 1e-30),
         ("ADOPT", adopt_reference, (0.8, 0.9), 1e-3), ("RMSPropMomentum", rmsprop_reference, (0.7, 0.9), 1e-3)]


def gradients(shape: torch.Size, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (0.5 + i) for i in range(STEPS)]


@pytest.mark.parametrize(("kind", "reference", "betas", "eps"), CASES)
def test_update_over_steps_equals_levanters_formula(kind: str, reference: Any, betas: tuple[float, float],
                                                    eps: float) -> None:
    model = Tiny()
    start = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: gradients(p.shape, seed) for seed, (n, p) in enumerate(model.named_parameters())}
    cfg = config_from_mapping({"optimizer": {"type": kind, "params": {"lr": LR, "betas": list(betas), "eps": eps}},
                               "weight_decay": WD}).args
    optimizer = build_optimizer(model, cfg)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            p.grad = grads[name][step].clone()
        optimizer.step()
    for name, p in model.named_parameters():
        decay = WD if name.endswith("weight") else 0.0
        expected = reference(start[name], [g.double().numpy() for g in grads[name]], decay, *betas, eps)
        np.testing.assert_allclose(p.detach().double().numpy(), expected, rtol=0, atol=1e-6)
        assert not np.allclose(expected, start[name], atol=1e-3)  # the steps moved it: the check can fail


@pytest.mark.parametrize("cls", [LevanterAdopt, LevanterRMSPropMomentum])
def test_resume_from_the_state_dict_is_exact(cls: type[LevanterOptimizer]) -> None:
    grads = gradients(torch.Size([3, 4]), 7)

    def run(steps: range, p: torch.nn.Parameter, opt: torch.optim.Optimizer) -> None:
        for i in steps:
            p.grad = grads[i].clone()
            opt.step()

    straight = torch.nn.Parameter(torch.ones(3, 4))
    run(range(STEPS), straight, cls([straight], lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=WD))
    first = torch.nn.Parameter(torch.ones(3, 4))
    opt = cls([first], lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=WD)
    run(range(3), first, opt)
    saved, weights = opt.state_dict(), first.detach().clone()
    resumed = torch.nn.Parameter(weights)
    opt = cls([resumed], lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=WD)
    opt.load_state_dict(saved)
    run(range(3, STEPS), resumed, opt)
    assert torch.equal(resumed.detach(), straight.detach())


MODEL = "model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"


def load(tmp_path: Path, text: str) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(MODEL + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


# AdoptConfig (adopt.py:18-31@9263f81e): beta1 0.9, beta2 0.95, epsilon 1e-6; RMSPropMomentumConfig
# (rmsprop.py:20-27): beta1 0.9, beta2 0.99, eps 1e-30; both weight_decay 0.1, max_grad_norm 1.0 and
# OptimizerConfig's learning_rate 6e-4
@pytest.mark.parametrize(("text", "cls", "betas", "eps"), [
    ("optimizer:\n  type: adopt\n", LevanterAdopt, (0.9, 0.95), 1e-6),
    ("optimizer:\n  type: rmsprop\n", LevanterRMSPropMomentum, (0.9, 0.99), 1e-30),
    ("optimizer:\n  type: adopt\n  beta2: 0.99\n  epsilon: 1.0e-8\n  schedule_list: [a]\n", LevanterAdopt,
     (0.9, 0.99), 1e-8),
    ("optimizer:\n  type: rmsprop\n  beta1: 0.8\n  eps: 1.0e-8\n  max_grad_norm: 0.5\n  weight_decay: 0.0\n",
     LevanterRMSPropMomentum, (0.8, 0.99), 1e-8),
])
def test_levanter_yaml_builds_the_optimizer_with_levanters_defaults(tmp_path: Path, text: str, cls: type,
                                                                    betas: tuple[float, float], eps: float) -> None:
    args = load(tmp_path, text)
    optimizer = build_optimizer(Tiny(), args)
    assert type(optimizer) is cls
    assert optimizer.defaults["betas"] == betas and optimizer.defaults["eps"] == eps
    assert optimizer.defaults["lr"] == 6e-4
    explicit = "weight_decay: 0.0" in text
    assert optimizer.param_groups[0]["weight_decay"] == (0.0 if explicit else 0.1)
    assert args.gradient_clipping == (0.5 if explicit else 1.0)


@pytest.mark.parametrize(("text", "words"), [
    ("optimizer:\n  type: rmsprop\n  epsilon: 1.0e-8\n", "rmsprop optimizer has no epsilon; it has beta1, beta2, eps"),
    ("optimizer:\n  type: adopt\n  eps: 1.0e-8\n", "adopt optimizer has no eps"),
    ("optimizer:\n  type: adam\n  schedule_list: [a]\n", "only Levanter's adopt"),
    ("optimizer:\n  type: adopt\n  skip_bad_steps: true\n", "only Levanter's adam optimizer has skip_bad_steps"),
])
def test_fields_the_type_does_not_have_are_refused(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, text)
