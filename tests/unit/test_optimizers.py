"""Optimizers come from the config registry, with decay only on matrices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.errors import ConfigError
from megatron.training.optimizers import (
    OPTIMIZERS,
    Lion,
    build_optimizer,
    optimizer_settings,
    param_groups,
)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.final_norm = torch.nn.LayerNorm(4)
        self.norm_like_matrix = torch.nn.Parameter(torch.ones(2, 2))  # "norm" in the name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(self.linear(x)).sum()


def _args(kind: str, **params: object) -> SimpleNamespace:
    return SimpleNamespace(optimizer={"type": kind, "params": {"lr": 0.01, **params}}, lr=None, weight_decay=0.1)


def test_registry_keys() -> None:
    assert {"adam", "adamw", "cpu_adam", "lion", "sgd"} <= set(OPTIMIZERS)


def test_no_decay_on_biases_and_norms() -> None:
    model = Tiny()
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model.linear.weight)}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert len(groups[1]["params"]) == 4  # linear.bias, norm weight+bias, norm_like_matrix


def test_adam_is_decoupled_adamw_and_takes_lr_from_params() -> None:
    opt = build_optimizer(Tiny(), _args("Adam", betas=[0.9, 0.95], eps=1e-6))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_top_level_lr_wins() -> None:
    args = _args("AdamW")
    args.lr = 0.5
    assert optimizer_settings(args)[2] == 0.5


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD", "Lion", "CPU_Adam"])
def test_each_optimizer_reduces_a_quadratic(kind: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, _args(kind))
    x = torch.randn(8, 4)
    first = None
    for _ in range(20):
        loss = (model.linear(x) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first


def test_lion_update_is_sign_of_interpolation() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    p.grad = torch.tensor([0.3, -2.0, 0.0])
    opt.step()
    # momentum starts at 0, so the update is sign(0.1 * grad)
    assert torch.allclose(p.detach(), torch.tensor([0.9, -0.9, 0.5]))
    assert torch.allclose(opt.state[p]["exp_avg"], 0.01 * torch.tensor([0.3, -2.0, 0.0]))


def test_unknown_type_and_params_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="Adafactor"):
        build_optimizer(Tiny(), _args("Adafactor"))
    with pytest.raises(ConfigError, match="momentum"):
        build_optimizer(Tiny(), _args("Adam", momentum=0.9))
    with pytest.raises(ConfigError, match="betas"):
        build_optimizer(Tiny(), _args("Adam", betas=[0.9]))


def test_offloaded_adam_becomes_deepspeed_cpu_adam() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert isinstance(build_optimizer(Tiny(), _args("AdamW"), offload=True), DeepSpeedCPUAdam)
    assert isinstance(build_optimizer(Tiny(), _args("Lion"), offload=True), Lion)  # only Adam is switched
