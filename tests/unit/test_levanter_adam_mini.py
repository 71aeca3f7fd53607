"""Levanter's Adam-mini: Deepy's AdamMini against Levanter's formula, its resume, its YAML and its refusals.

The reference below re-writes stanford-crfm/levanter 9263f81e's ``MiniConfig`` (``src/levanter/optim/adam_mini.py``)
in float64 NumPy on Levanter's own arrays: each Deepy parameter is first laid out as Levanter's stacked, out-first
Llama leaf (a leading layer axis; ``q_proj`` (layers, kv_heads, q_per_group, head_size, embed), ``k_proj``/``v_proj``
(layers, kv_heads, head_size, embed), ``o_proj`` (layers, embed, heads, head_size), llama.py:264-266,446,503), labelled
as ``create_mask`` does (adam_mini.py:82-105), and stepped with ``scale_with_mini``'s per-axis means
(adam_mini.py:139-176) or the ``adamw`` chain (clip_by_global_norm over its own leaves, scale_by_adam), then
``add_decayed_weights`` with Levanter's default mask and ``scale(-lr)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.config_rules import Device
from megatron.engine.levanter_adam_mini import LevanterAdamMini
from megatron.engine.optimizers import build_optimizer
from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import config_from_mapping, load_config

STEPS, LR, WD = 4, 0.01, 0.1
HEADS, KV, D, HIDDEN = 4, 2, 4, 16
Arrays = dict[str, np.ndarray]


def model() -> GPTModel:
    return GPTModel(GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_kv_heads=KV,
                              seq_length=4, padded_vocab_size=16, seed=3, pos_emb="rotary", activation="swiglu",
                              norm="rmsnorm", intermediate_size=24, no_weight_tying=True, use_bias_in_qkv=True))


# --- Levanter's leaves: (label, array) from a Deepy parameter, and back -----------------------------------------
MEAN_AXES = {"embedding": (1,), "lm_head": (1,), "query": (2, 3, 4), "key": (2, 3), "value": (3,), "output": (2, 3),
             "linear": (2,)}
"""MiniConfig.build's transformations (adam_mini.py:65-73)."""


def levanter_leaves(name: str, a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if "word_embeddings" in name:
        return [("embedding", a)]
    if "output_layer" in name:
        return [("lm_head", a)]  # hnn.Linear(In=Embed, Out=Vocab, out_first=True): (vocab, embed)
    if "query_key_value" in name:
        q, k, v = np.split(a, [HEADS * D, (HEADS + KV) * D])
        rest = q.shape[1:]
        return [("query", q.reshape(1, KV, HEADS // KV, D, *rest)), ("key", k.reshape(1, KV, D, *rest)),
                ("value", v.reshape(1, KV, D, *rest))]
    if "attention.dense.weight" in name:
        return [("output", a.reshape(1, HIDDEN, HEADS, D))]  # o_proj: Out=Embed, In=(Heads, HeadSize)
    if "attention.dense.bias" in name:
        return [("output", a.reshape(1, HIDDEN))]
    if "mlp" in name and name.endswith("weight"):
        return [("linear", a[None])]
    return [("adamw", a[None])]  # norms and the MLP's biases (a Linear's bias: "adamw")


def deepy_array(name: str, leaves: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([leaf.reshape(-1, *shape[1:]) for leaf in leaves]).reshape(shape)


def decayed(name: str, shape: tuple[int, ...]) -> bool:
    """build_weight_decay_mask's default (config.py:148-160): not norms, embeddings, biases."""
    return len(shape) == 2 and "embeddings" not in name


def mini_reference(params: Arrays, steps: list[Arrays], b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   max_grad_norm: float = 1.0, axes: dict[str, tuple[int, ...]] = MEAN_AXES) -> Arrays:
    names = list(params)
    shapes = {n: params[n].shape for n in names}
    p = {n: levanter_leaves(n, params[n]) for n in names}
    m = {n: [np.zeros_like(a) for _, a in p[n]] for n in names}
    v = {n: [np.zeros_like(a) for _, a in p[n]] for n in names}
    for count, step in enumerate(steps, start=1):
        g = {n: [a for _, a in levanter_leaves(n, step[n])] for n in names}
        adamw = [g[n][i] for n in names for i, (label, _) in enumerate(p[n]) if label == "adamw"]
        norm = np.sqrt(sum((x**2).sum() for x in adamw))
        clip = 1.0 if norm < max_grad_norm else max_grad_norm / norm  # optax.clip_by_global_norm
        for n in names:
            for i, (label, leaf) in enumerate(p[n]):
                grad = g[n][i] * clip if label == "adamw" else g[n][i]
                m[n][i] = b1 * m[n][i] + (1 - b1) * grad
                if label == "adamw":  # scale_by_adam
                    v[n][i] = b2 * v[n][i] + (1 - b2) * grad**2
                else:  # calc_and_update_second_moment, axis by axis as Levanter writes it
                    squared = grad * grad
                    for axis in sorted(axes[label], reverse=True):
                        if axis < squared.ndim:
                            squared = squared.mean(axis=axis, keepdims=True)
                    for axis in sorted(axes[label], reverse=True):
                        if axis < grad.ndim:
                            squared = squared.repeat(grad.shape[axis], axis=axis)
                    v[n][i] = v[n][i] * b2 + squared * (1 - b2)
                update = (m[n][i] / (1 - b1**count)) / (np.sqrt(v[n][i] / (1 - b2**count)) + eps)
                if decayed(n, shapes[n]):
                    update = update + WD * leaf
                p[n][i] = (label, leaf + (-LR) * update)
    return {n: deepy_array(n, [a for _, a in p[n]], shapes[n]) for n in names}


def gradients(net: torch.nn.Module, seed: int, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) * (0.5 + i) for n, p in net.named_parameters()}
            for i in range(steps)]


def built(net: torch.nn.Module, params: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    cfg = config_from_mapping({"optimizer": {"type": "AdamMini", "params": {"lr": LR, **(params or {})}},
                               "weight_decay": WD, "weight_decay_embeddings": False}).args
    return build_optimizer(net, cfg)


def test_update_over_steps_equals_levanters_formula() -> None:
    net = model()
    start = {n: p.detach().double().numpy().copy() for n, p in net.named_parameters()}
    grads = gradients(net, 1)
    optimizer = built(net)
    assert type(optimizer) is LevanterAdamMini
    for step in grads:
        for name, p in net.named_parameters():
            p.grad = step[name].clone()
        optimizer.step()
    expected = mini_reference(dict(start), [{n: g.double().numpy() for n, g in s.items()} for s in grads])
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)
        assert not np.allclose(expected[name], start[name], atol=1e-4), name  # it moved: the check can fail
    # the blocks matter: element-wise second moments (plain Adam on those leaves) land elsewhere on the attention
    elementwise: dict[str, tuple[int, ...]] = {label: () for label in MEAN_AXES}
    adam = mini_reference(dict(start), [{n: g.double().numpy() for n, g in s.items()} for s in grads], axes=elementwise)
    qkv = "layers.0.attention.query_key_value.weight"
    assert np.abs(adam[qkv] - expected[qkv]).max() > 1e-4


def test_resume_from_the_state_dict_is_exact() -> None:
    grads = gradients(model(), 7, 6)

    def run(steps: range, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for i in steps:
            for name, p in net.named_parameters():
                p.grad = grads[i][name].clone()
            opt.step()

    straight = model()
    run(range(6), straight, built(straight))
    first = model()
    opt = built(first)
    run(range(3), first, opt)
    saved = opt.state_dict()
    resumed = model()
    resumed.load_state_dict(first.state_dict())
    opt = built(resumed)
    opt.load_state_dict(saved)
    run(range(3, 6), resumed, opt)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


MODEL = "model:\n  type: llama\n  hidden_dim: 16\n  num_heads: 4\n  num_kv_heads: 2\n  num_layers: 2\n"


def load(tmp_path: Path, text: str, model_text: str = MODEL) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(model_text + text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed).args


def test_levanter_mini_yaml_builds_adam_mini_with_levanters_defaults(tmp_path: Path) -> None:
    """MiniConfig (adam_mini.py:30-36@9263f81e): beta1 0.9, beta2 0.95, epsilon 1e-8, weight_decay 0.0,
    max_grad_norm 1.0 (inside, on the AdamW half); its lr and nesterov are never read; learning_rate 6e-4
    (OptimizerConfig)."""
    args = load(tmp_path, "optimizer:\n  type: mini\n  lr: 0.5\n  nesterov: true\n")
    optimizer = build_optimizer(model(), args)
    assert type(optimizer) is LevanterAdamMini
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-8
    assert optimizer.defaults["lr"] == 6e-4 and args.weight_decay == 0.0 and args.gradient_clipping == 0.0
    assert optimizer.max_grad_norm == 1.0 and args.sharding_strategy == "fsdp"  # ZeRO-3, gathered
    args = load(tmp_path, "optimizer:\n  type: mini\n  beta2: 0.99\n  max_grad_norm: 0.5\n  weight_decay: 0.05\n")
    assert args.optimizer.params.betas == (0.9, 0.99) and args.optimizer.params.inner_max_grad_norm == 0.5
    assert args.weight_decay == 0.05
    with pytest.raises(ConfigError, match="fused c_attn"):
        load(tmp_path, "optimizer:\n  type: mini\n", MODEL.replace("llama", "gpt2").replace("  num_kv_heads: 2\n", ""))


LAUNCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, train_iters=4, lr=1e-3,
              train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
              pipe_parallel_size=0, gradient_clipping=0.0, optimizer={"type": "AdamMini"})


def refused(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        finalize(config_from_mapping({**LAUNCH, **keys}), 2, device=Device(cuda=False, fp16_supported=False))
    return info.value.message


def test_layouts_that_cut_rows_are_refused_before_launch() -> None:
    # ZeRO 1-3 and tp run (tests/distributed/test_levanter_optimizers_zero.py, test_levanter_whole_tensor_tp.py)
    assert "remove offload_optimizer" in refused(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert "a pipeline stage holds part of the layers" in refused(pipe_parallel_size=2)
    assert "set gradient_clipping: 0" in refused(gradient_clipping=1.0)
    finalize(config_from_mapping(LAUNCH), 2, device=Device(cuda=False, fp16_supported=False))
    finalize(config_from_mapping({**LAUNCH, "zero_optimization": {"stage": 3}}), 2,
             device=Device(cuda=False, fp16_supported=False))
