"""Every architectural option is one registry entry: building each entry's module gives the parameter count
the entry states, and a whole model with that option has the parameter count the FLOPs module
(``num_parameters``) and the memory estimate (``stage_parameters``) give; the FLOPs per token are 6 per weight
a token passes through (counted on the built model) plus 3 x the mixing term. A toy norm added as one plug-in
file (``tests/fixtures/toy_norm.py``) computes its formula and goes through ``deepy.py --dry-run`` and a
2-step run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.model.activations import ACTIVATIONS
from megatron.model.config import Activation, GPTConfig, PositionEmbedding
from megatron.model.family_config import FAMILIES, FAMILY_OF_TYPE, FamilyName, family_of, token_mixing_flops
from megatron.model.flops import flops_per_token, num_parameters
from megatron.model.gpt import GPTModel
from megatron.model.norms import NORMS
from megatron.model.transformer_options import ATTENTION_TYPES, MLP_TYPES, NORM_PLACEMENTS, POSITIONAL
from megatron.engine.memory import MemoryLayout, stage_parameters

REPO = Path(__file__).resolve().parents[2]
TOY_NORM = REPO / "tests" / "fixtures" / "toy_norm.py"
TORCH_NORMS = [n for n in NORMS if NORMS[n].gpu_library is None]
"""Norms built anywhere; Transformer Engine's need an NVIDIA GPU (tests/gpu/test_transformer_engine.py)."""
BASE: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, padded_vocab_size=64,
                            max_position_embeddings=8, intermediate_size=96, gmlp_attn_dim=8)
# one option changed at a time from BASE; the variants make each entry's module matter (a per-head norm,
# GQA's key/value heads, a learned bias per bucket)
OPTIONS: dict[str, dict[str, Any]] = {
    **{f"norm={n}": dict(norm=n, use_qk_layernorm=True) for n in TORCH_NORMS},
    "norm=layernorm without bias": dict(norm="layernorm", use_bias_in_norms=False),
    **{f"norm_placement={n}": dict(norm_placement=n) for n in ("post", "sandwich")},
    "qk_norm_scope=projection (OLMo 2)": dict(norm="rmsnorm", use_qk_layernorm=True, qk_norm_scope="projection",
                                              num_kv_heads=1),
    "use_bias_in_qkv (Qwen2)": dict(use_bias_in_attn_linear=False, use_bias_in_qkv=True, num_kv_heads=1),
    "kv_channels (Qwen3, Gemma)": dict(kv_channels=24, num_kv_heads=1, use_qk_layernorm=True),
    # Gemma 2/3's keys without parameters of their own: the counts must not move
    "Gemma's caps, query scalar, scaled embeddings, local rotary base": dict(
        query_pre_attn_scalar=5.0, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pos_emb="rotary",
        scale_embeddings_by_sqrt_hidden=True, attention_config=[[["local", "global"], 1]], sliding_window_width=3,
        rope_local_base_freq=100),
    **{f"activation={a}": dict(activation=a) for a in ACTIVATIONS},
    **{f"pos_emb={p}": dict(pos_emb=p, num_kv_heads=1) for p in POSITIONAL},
    **{f"attention={t}": dict(attention_config=[[[t], "all"]], sliding_window_width=3) for t in ATTENTION_TYPES},
    **{f"mlp_type={m}": dict(mlp_type=m, activation="swiglu") for m in MLP_TYPES},
    **{f"family={t}": dict(attention_config=[[[t], "all"]], norm="rmsnorm") for t in FAMILY_OF_TYPE},
}


def _memory_count(config: GPTConfig) -> int:
    return stage_parameters(MemoryLayout(
        model=config, tp=1, pp=1, dp=1, precision="fp32", zero_stage=0, offload_optimizer=False,
        contiguous_gradients=False, overlap_comm=False, reduce_bucket_size=0, optimizer_states=2, micro_batch=1,
        seq_length=config.seq_length, grad_accum=1, recomputed_layers=0, sequence_parallel=False, dropout=False))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_option_counts_what_it_builds(option: str) -> None:
    config = GPTConfig(**{**BASE, **OPTIONS[option]})
    model = GPTModel(config)
    params = dict(model.named_parameters())
    real = sum(p.numel() for p in params.values())
    assert num_parameters(config) == real == _memory_count(config), option
    # FLOPs per token, counted on the built model: every weight but the lookup tables and gMLP's spatial
    # projection (it mixes positions: its term is the mixing one) takes 6 per token; the tied output
    # projection once more; plus 3 x each layer's forward mixing FLOPs
    tables = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
    matmul = sum(p.numel() for name, p in params.items() if name not in tables and ".sgu.proj." not in name)
    h, s = config.hidden_size, config.seq_length
    mixing = sum(token_mixing_flops(config, kind, s) for kind in config.attention_types)
    if all(family_of(kind) == "transformer" for kind in config.attention_types):
        width = config.num_attention_heads * (config.kv_channels or h // config.num_attention_heads)
        assert mixing == config.num_layers * 4 * s * width  # q.k and p.v over the full sequence, heads x head_dim
    assert flops_per_token(config) == 6 * (matmul + config.padded_vocab_size * h) + 3 * mixing, option


@pytest.mark.parametrize("name", TORCH_NORMS)
def test_each_norm_entry_builds_the_parameters_it_states(name: str) -> None:
    config = GPTConfig(**{**BASE, "norm": name})
    entry, settings = NORMS[name], config.norm_settings
    for dim in (config.hidden_size, config.head_dim):
        assert sum(p.numel() for p in entry.build(dim, settings).parameters()) == entry.parameters(dim, settings)
    assert entry.flops_per_token(32, settings) == 6 * entry.parameters(32, settings)


NORM_KEY_CHANGES: dict[str, Any] = {"use_bias_in_norms": False, "layernorm_epsilon": 0.5, "rms_norm_epsilon": 0.5,
                                    "scalenorm_epsilon": 100.0}
"""Each norm key changed from its default to a value whose effect shows on a small input (an epsilon near the
input's scale, no bias)."""


@pytest.mark.parametrize("name", TORCH_NORMS)
def test_each_norm_entry_reads_exactly_the_keys_it_states(name: str) -> None:
    """``NormEntry.reads`` (what ``GPTConfig.keys_without_effect`` leaves out of the converter's check): changing
    a key it reads changes the module's parameters or output; changing any other key changes neither (an
    RMSNorm with ``use_bias_in_norms: false`` is the same module, as in GPT-NeoX, whose get_norm hands RMSNorm only
    its epsilon: megatron/model/norms.py:19-59, transformer.py:931-934 at ea7aefd8)."""
    from megatron.model.norms import NORM_KEYS

    assert set(NORM_KEY_CHANGES) == set(NORM_KEYS)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))

    def built(**changes: Any) -> tuple[dict[str, tuple[int, ...]], torch.Tensor]:
        config = GPTConfig(**{**BASE, "norm": name, **changes})
        module = NORMS[name].build(32, config.norm_settings)
        for p in module.parameters():  # not the constant init: a missing bias or scale would show
            torch.nn.init.uniform_(p, 0.5, 1.5, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            return {n: tuple(p.shape) for n, p in module.named_parameters()}, module(x)

    shapes, out = built()
    for key, value in NORM_KEY_CHANGES.items():
        changed_shapes, changed_out = built(**{key: value})
        same = changed_shapes == shapes and torch.equal(changed_out, out)
        assert same == (key not in NORMS[name].reads), (name, key)
        assert (key in GPTConfig(**{**BASE, "norm": name}).keys_without_effect()) == same, (name, key)


def test_the_config_values_are_the_registries_names() -> None:
    """The keys' accepted values come from the registries (``norm`` validates against its registry, the
    others' Literals are checked here), so a new entry cannot be missing from one of them."""
    assert set(typing.get_args(PositionEmbedding)) == set(POSITIONAL)
    assert set(typing.get_args(Activation)) == set(ACTIVATIONS)
    assert set(typing.get_args(GPTConfig.model_fields["mlp_type"].annotation)) == set(MLP_TYPES)
    assert set(typing.get_args(GPTConfig.model_fields["norm_placement"].annotation)) == set(NORM_PLACEMENTS)
    assert set(typing.get_args(FamilyName)) == set(FAMILIES)
    from megatron.config_support import KNOWN_ATTENTION_TYPES, UNSUPPORTED_ATTENTION_TYPES

    assert KNOWN_ATTENTION_TYPES - UNSUPPORTED_ATTENTION_TYPES == set(ATTENTION_TYPES) | set(FAMILY_OF_TYPE)
    with pytest.raises(ValueError, match="not a registered norm"):
        GPTConfig(**BASE, norm="batchnorm")


def test_each_family_entry_names_its_pipeline_layer() -> None:
    """A family's entry states its block plain and as a pipeline layer (one table, not a second dict keyed by
    family); DeepSpeed's activation checkpointing and stage balancing find the blocks by those names."""
    from megatron.model.pipeline import BLOCK_PARTITION, CHECKPOINTABLE_LAYERS, pipeline_layer_specs

    for name, entry in FAMILIES.items():
        pipe, plain = entry.pipe_class(), entry.block_class()
        assert issubclass(pipe, plain) and pipe is not plain, (name, pipe, plain)
        assert pipe.__name__ in CHECKPOINTABLE_LAYERS and f"^{pipe.__name__}$" in BLOCK_PARTITION
    specs = pipeline_layer_specs(GPTConfig(**BASE, attention_config=[[["mamba", "rwkv"], 1]]))
    assert [spec.typename.__name__ for spec in specs[1:3]] == ["MambaLayerPipe", "RWKVLayerPipe"]


# --- a toy norm, one plug-in file ------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_norm() -> Iterator[None]:
    """The toy registered in this process for this module's tests, and forgotten after them."""
    from megatron import plugins

    saved = NORMS.items()
    plugins.load_user_plugins([str(TOY_NORM)])
    yield
    NORMS._entries.clear()
    NORMS._owners.clear()
    for name, entry in saved:
        NORMS.register(name, entry, "megatron.model.norms")
    plugins._USER_MODULES.pop(str(TOY_NORM), None)


def test_toy_norm_computes_its_formula_and_counts_its_parameters(toy_norm: None) -> None:
    config = GPTConfig(**{**BASE, "norm": "l1norm", "use_qk_layernorm": True})
    norm = NORMS["l1norm"].build(32, config.norm_settings)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 32))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    expected = torch.linspace(0.5, 2.0, 32) * x / (x.abs().sum(-1, keepdim=True) / 32 + config.layernorm_epsilon)
    torch.testing.assert_close(norm(x), expected)
    real = sum(p.numel() for p in GPTModel(config).parameters())
    assert num_parameters(config) == real == _memory_count(config)
    # 2 layers x (2 norms over h + q/k norms over the head dim) + the final norm
    assert real - num_parameters(config.replace(norm="non_parametric_layernorm")) == 2 * (2 * 32 + 2 * 16) + 32


def test_toy_norm_runs_through_deepy_dry_run_and_two_steps(toy_norm: None, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The dry run in this process (the plug-in is imported by the ``plugins`` key as on the launcher), then one
    1-rank launch of 2 steps (the ranks import it again)."""
    from megatron.app.deepy import main

    config = tmp_path / "toy.yml"
    config.write_text(textwrap.dedent(f"""\
        plugins: [{TOY_NORM}]
        norm: l1norm
        num_layers: 2
        hidden_size: 32
        num_attention_heads: 2
        seq_length: 16
        max_position_embeddings: 16
        tokenizer_type: CharLevelTokenizer
        use_dummy_dataset: true
        train_micro_batch_size_per_gpu: 2
        train_iters: 2
        log_interval: 1
        eval_iters: 0
        num_workers: 0
        num_gpus: 1
        lr: 0.001
        log_dir: logs
        """), encoding="utf-8")
    assert main(["--dry-run", str(REPO / "train.py"), str(config)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["norm"])
    assert "l1norm" in row and f"{config.name}:2" in row, row
    # the whole-model count includes the toy's 5 norms of 32 gains (CharLevelTokenizer's 512 rows, no table)
    like_toy = GPTConfig(**{**BASE, "seq_length": 16, "max_position_embeddings": 16, "padded_vocab_size": 512,
                            "intermediate_size": None, "norm": "rmsnorm"})  # rmsnorm: h gains, like the toy
    assert f"Model: {num_parameters(like_toy):,} parameters" in out, out
    from ports import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("DEEPY_DEBUG", None)
    run = subprocess.run([sys.executable, str(REPO / "deepy.py"), str(REPO / "train.py"), str(config),
                          f"master_port={free_port()}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = [json.loads(line) for line in next((tmp_path / "logs").rglob("metrics.jsonl")).read_text().splitlines()]
    losses = {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}
    assert sorted(losses) == [1, 2] and all(0 < loss < 20 for loss in losses.values()), losses
