"""Optimizers come from the typed optimizer block, with decay only on matrices."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron.errors import ConfigError
from megatron.neox_arguments import config_from_mapping
from megatron.engine.optimizer_config import OptimizerArgs
from megatron.engine.optimizers import OPTIMIZERS, build_optimizer, param_groups


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.final_norm = torch.nn.LayerNorm(4)
        self.norm_like_matrix = torch.nn.Parameter(torch.ones(2, 2))  # "norm" in the name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(self.linear(x)).sum()


def optimizer_config(kind: str, top: dict[str, Any] | None = None, **params: Any) -> OptimizerArgs:
    """Through the real loader: the schema validates the block, OptimizerArgs' properties read it."""
    values = {"optimizer": {"type": kind, "params": {"lr": 0.01, **params}}, "weight_decay": 0.1, **(top or {})}
    return config_from_mapping(values).args


def test_registry_keys() -> None:
    assert {"adam", "cpu_adam", "lion", "sgd", "sm3", "madgrad_wd"} <= set(OPTIMIZERS)


def test_no_decay_on_biases_and_norms() -> None:
    model = Tiny()
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model.linear.weight)}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert len(groups[1]["params"]) == 4  # linear.bias, norm weight+bias, norm_like_matrix


def test_adam_is_decoupled_adamw_and_takes_lr_from_params() -> None:
    opt = build_optimizer(Tiny(), optimizer_config("Adam", betas=[0.9, 0.95], eps=1e-6))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert opt.param_groups[0]["eps"] == 1e-6


def test_top_level_lr_wins() -> None:
    assert optimizer_config("AdamW", top={"lr": 0.5}).peak_lr == 0.5
    assert optimizer_config("AdamW").peak_lr == 0.01  # optimizer.params.lr otherwise


@pytest.mark.parametrize(("flat", "block", "expected"), [
    (0.5, None, (0.5, "lr")), (None, 0.01, (0.01, "optimizer.params.lr")), (0.01, 0.01, (0.01, "lr")),
    (None, None, (None, "lr")),
])
def test_the_peak_rate_is_decided_in_one_place(flat: float | None, block: float | None,
                                               expected: tuple[float | None, str]) -> None:
    """The optimizer, the pre-launch rules and deepy.py's inference fill-in all ask peak_lr_setting
    (the flat lr when given, else optimizer.params.lr), so none of them can disagree."""
    from megatron.app.deepy import fill_in_for_inference
    from megatron.neox_arguments.loading import config_from_mapping
    from megatron.engine.optimizer_config import peak_lr_setting

    values: dict[str, Any] = {} if flat is None else {"lr": flat}
    if block is not None:
        values["optimizer"] = {"type": "Adam", "params": {"lr": block}}
    resolved = config_from_mapping(values)
    args = resolved.args
    assert peak_lr_setting(args.lr, args.optimizer) == expected
    if expected[0] is None:
        with pytest.raises(ConfigError, match="no learning rate"):
            args.peak_lr
        fill_in_for_inference(resolved, "generate.py")  # a model-only config gets lr 0 for the engine
        assert args.lr == 0.0 and peak_lr_setting(args.lr, args.optimizer) == (0.0, "lr")
    else:
        assert args.peak_lr == expected[0]
        fill_in_for_inference(resolved, "generate.py")
        assert args.lr == flat  # a rate the config gives is left alone


def test_only_the_decision_reads_the_block_lr() -> None:
    """``optimizer.params.lr`` is read where the peak rate is decided and by the rule refusing a block lr
    that disagrees with the flat lr, nowhere else in megatron/ (a second decision would show up here)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "megatron"
    readers = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr == "lr" and isinstance(node.value, ast.Attribute) \
                            and node.value.attr == "params":
                        readers.add(f"{path.relative_to(root.parent)}:{fn.name}")
    assert readers == {"megatron/engine/optimizer_config.py:peak_lr_setting",
                       "megatron/engine/optimizer_checks.py:learning_rates_ordered"}


def test_weight_decay_in_params_is_honoured() -> None:
    cfg = optimizer_config("AdamW", weight_decay=0.3)
    assert cfg.applied_weight_decay == 0.3
    opt = build_optimizer(Tiny(), cfg)
    assert opt.param_groups[0]["weight_decay"] == 0.3 and opt.param_groups[1]["weight_decay"] == 0.0
    assert optimizer_config("AdamW").applied_weight_decay == 0.1  # the flat key otherwise


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD", "Lion", "CPU_Adam", "CPU_torch_adam", "SM3", "madgrad_wd"])
def test_each_optimizer_reduces_a_quadratic(kind: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, optimizer_config(kind))
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
    model = torch.nn.Module()
    model.register_parameter("w", p)  # a vector: no decay group
    opt = build_optimizer(model, optimizer_config("Lion", lr=0.1, betas=[0.9, 0.99]))
    p.grad = torch.tensor([0.3, -2.0, 0.0])
    opt.step()
    # momentum starts at 0, so the update is sign(0.1 * grad)
    assert torch.allclose(p.detach(), torch.tensor([0.9, -0.9, 0.5]))


@pytest.mark.parametrize("kind", ["SM3", "madgrad_wd"])
def test_weight_decay_is_applied_decoupled(kind: str) -> None:
    """A zero gradient leaves only the decay: p <- p * (1 - lr * wd) on matrices, nothing on vectors."""
    model = Tiny()
    before = model.linear.weight.detach().clone()
    bias = model.linear.bias.detach().clone()
    opt = build_optimizer(model, optimizer_config(kind, lr=0.5, weight_decay=0.2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(model.linear.weight.detach(), before * (1 - 0.5 * 0.2))
    torch.testing.assert_close(model.linear.bias.detach(), bias)


def test_bad_blocks_are_config_errors_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match="SM3"):  # the message lists the types
        config_from_mapping({"optimizer": {"type": "Adafactor"}})
    with pytest.raises(ConfigError, match="momentum"):
        config_from_mapping({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})
    with pytest.raises(ConfigError, match="betas"):
        config_from_mapping({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})
    with pytest.raises(ConfigError, match="lr"):
        config_from_mapping({"optimizer": {"type": "Adam", "params": {"lr": "abc"}}})


def test_offloaded_adam_becomes_deepspeed_cpu_adam() -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert isinstance(build_optimizer(Tiny(), optimizer_config("AdamW"), offload=True), DeepSpeedCPUAdam)
    assert not isinstance(build_optimizer(Tiny(), optimizer_config("Lion"), offload=True), DeepSpeedCPUAdam)


@pytest.mark.parametrize("kind", ["adam", "cpu_torch_adam", "sgd", "lion", "sm3", "madgrad_wd"])
def test_flat_optimizer_type_without_a_block_gets_gpt_neox_defaults(kind: str) -> None:
    """No ``optimizer`` block, only ``lr`` and ``optimizer_type``: the type's GPT-NeoX defaults fill
    every parameter (the same optimizer an empty block of that type builds), so the ranks never meet a
    missing ``betas``/``momentum``."""
    flat = config_from_mapping({"optimizer_type": kind, "lr": 0.01}).args
    block_type = {"cpu_torch_adam": "CPU_torch_adam"}.get(kind, kind)
    block = config_from_mapping({"optimizer": {"type": block_type, "params": {"lr": 0.01}}}).args
    assert (flat.optimizer_kind, dict(flat.optimizer_params)) == (block.optimizer_kind, dict(block.optimizer_params))
    optimizer = build_optimizer(Tiny(), flat)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("betas", "momentum", "eps")}
    assert defaults, optimizer.defaults
    # the values torch received are the schema's defaults (AdamW's betas (0.9, 0.999), SGD momentum 0)
    for key, value in defaults.items():
        expected = flat.optimizer_params[key]
        assert (tuple(value) == tuple(expected)) if key == "betas" else (value == expected), key


def test_zero_init_placeholders_are_grouped_by_their_real_shape() -> None:
    """Under deepspeed.zero.Init a weight is an empty 1-d placeholder whose shape DeepSpeed keeps as
    ``ds_shape``: a matrix is still decayed (it was not, so zero_init runs skipped weight decay)."""
    import torch

    from megatron.engine.optimizers import is_no_decay

    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_shape = torch.Size([8, 4])  # what zero.Init sets
    assert not is_no_decay("layers.0.mlp.dense_h_to_4h.weight", placeholder)
    placeholder.ds_shape = torch.Size([8])
    assert is_no_decay("layers.0.mlp.dense_h_to_4h.scale", placeholder)
