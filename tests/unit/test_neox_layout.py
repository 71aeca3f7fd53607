"""GPT-NeoX's checkpoint layout against files written by test code from GPT-NeoX's published rules
(``tests/neox_reference_layout.py``: its current layout and its mid-2024 one): reading them gives the
source model back (logits equal), Deepy's writer produces the current files tensor for tensor, for
pp0/pp>=1, tp1/tp2, GPT-NeoX and Llama-style (rmsnorm, SwiGLU, grouped-query) models; and where the
files cannot say their grouped-query QKV order, every choice is either right, refused, or a model
that visibly differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from neox_reference_layout import neox_files, write_neox_checkpoint

from megatron.checkpointing.neox import (
    GQA_ORDER_OF_FORMAT,
    PER_QUERY_HEAD,
    PER_RANK,
    NeoxNames,
    gqa_order_for,
    neox_checkpoint_shards,
    qkv_from_neox,
    qkv_to_neox,
)
from megatron.errors import CheckpointError
from megatron.interop.deepy_checkpoint import merge_tp_shards, read_full_checkpoint, write_weights_only_checkpoint
from megatron.interop.hf_model import build_gpt_model
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTModel

NEOX = dict(norm="layernorm", activation="gelu", num_kv_heads=4, no_weight_tying=False, rotary_pct=0.25,
            use_bias_in_attn_linear=True, use_bias_in_mlp=True, intermediate_size=256)  # fmt: skip
# intermediate_size == mlp_multiple_of: the same 128-wide gated MLP under Deepy's width rule, GPT-NeoX's
# (transformer.py ParallelMLP: ceil(int(2/3 * 128) // 2 / 128) * 128) and its HF converter (reads it as is)
LLAMA = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, no_weight_tying=True, intermediate_size=128,
             mlp_multiple_of=128, use_bias_in_attn_linear=False, use_bias_in_mlp=False)  # fmt: skip


def config_of(arch: dict[str, Any], seed: int = 1234) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     padded_vocab_size=256, pos_emb="rotary", seed=seed, precision="fp32", **arch)


def source_weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPTModel(config)
    with torch.no_grad():  # non-trivial norms and biases too, so a misplaced one shows
        for param in model.parameters():
            param.normal_(0, 0.3)
    return {k: v.clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def logits(config: GPTConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    return build_gpt_model(config, weights)(tokens)


def reference(config: GPTConfig, full: dict[str, torch.Tensor], tp: int, pipeline: bool,
              era: str = "current") -> dict[str, dict[str, torch.Tensor]]:
    return neox_files(full, num_layers=2, heads=4, kv_heads=config.kv_heads, tp=tp, pipeline=pipeline,
                      llama=config.norm == "rmsnorm", era=era)


CASES = [(arch, tp, pipeline) for arch in ("neox", "llama") for tp in (1, 2) for pipeline in (False, True)]


@pytest.mark.parametrize("era", ["current", "mid2024"])
@pytest.mark.parametrize(("arch", "tp", "pipeline"), CASES)
def test_gpt_neox_layouts_read_back_to_the_same_model(tmp_path: Path, arch: str, tp: int, pipeline: bool,
                                                      era: str) -> None:
    """GPT-NeoX's current names (mlp.linear1/linear2, [up; gate] rows) and its mid-2024 ones
    (dense_h_to_4h, w1/w3/w2), each with its grouped-query order."""
    config = config_of(NEOX if arch == "neox" else LLAMA)
    full = source_weights(config)
    tag = write_neox_checkpoint(tmp_path, "global_step7", reference(config, full, tp, pipeline, era),
                                pipeline=pipeline, tp=tp, iteration=7)
    names = NeoxNames.from_config(config).reading(PER_RANK if era == "current" else PER_QUERY_HEAD)
    shards, found_tp = neox_checkpoint_shards(tag, names)
    read = merge_tp_shards(config, shards)
    assert found_tp == tp and set(read) == set(full)
    assert (logits(config, read) - logits(config, full)).abs().max() <= 1e-5


@pytest.mark.parametrize(("arch", "tp", "pipeline"), CASES)
def test_deepy_writes_gpt_neox_files_key_by_key(tmp_path: Path, arch: str, tp: int, pipeline: bool) -> None:
    """The converter's writer (the engine's translation, offline) against GPT-NeoX's current layout:
    mlp.linear1/linear2, each rank's [up; gate] rows, per-rank [Q; K; V] for grouped-query attention,
    RMSNorm ``scale``; ``args`` and ``configs/`` as GPT-NeoX's tools read them."""
    config = config_of(NEOX if arch == "neox" else LLAMA)
    full = source_weights(config)
    want = reference(config, full, tp, pipeline)
    ckpt = write_weights_only_checkpoint(tmp_path, config=config, weights=full, tp=tp, pp=1 if pipeline else 0,
                                         args={"padded_vocab_size": 256})
    pattern = "layer_*-model_states.pt" if pipeline else "mp_rank_*_model_states.pt"
    assert sorted(p.name for p in ckpt.glob(pattern)) == sorted(want)
    for name, tensors in want.items():
        got = torch.load(ckpt / name, weights_only=True)
        got = got if pipeline else got["module"]
        assert sorted(got) == sorted(tensors), name
        for key, tensor in tensors.items():
            assert torch.equal(got[key], tensor), f"{name}: {key}"
    configs = yaml.safe_load((ckpt / "configs" / "resolved.yml").read_text())
    assert (configs["pipe_parallel_size"], configs["model_parallel_size"]) == (1 if pipeline else 0, tp)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("order", [PER_RANK, PER_QUERY_HEAD])
def test_qkv_order_round_trips(heads: int, kv_heads: int, order: Any) -> None:
    t = torch.randn((heads + 2 * kv_heads) * 8, 5)
    neox = qkv_to_neox(t, heads, kv_heads, order)
    assert torch.equal(neox, t) == (order == PER_RANK and kv_heads != heads)  # only GQA per rank is [q; k; v]
    assert torch.equal(qkv_from_neox(neox, heads, kv_heads, order), t)


@pytest.mark.parametrize("pipeline", [False, True])
def test_parallel_residual_row_biases_sum_over_tp_ranks(tmp_path: Path, pipeline: bool) -> None:
    """With gpt_j_residual GPT-NeoX adds every rank's copy of a row-parallel bias before the
    all-reduce: the copies in the files sum to the model's bias, and read back to it."""
    config = config_of({**NEOX, "gpt_j_residual": True})
    full = source_weights(config)
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
            "max_position_embeddings": 16, "padded_vocab_size": 256, "pos_emb": "rotary", "seed": 1234, **NEOX,
            "gpt_j_residual": True}  # fmt: skip
    ckpt = write_weights_only_checkpoint(tmp_path, config=config, weights=full, tp=2, pp=1 if pipeline else 0,
                                         args=args)
    for ours, neox in (("attention.dense.bias", "attention.dense.bias"), ("mlp.dense_4h_to_h.bias", "mlp.linear2.bias")):
        if pipeline:
            copies = [torch.load(ckpt / f"layer_02-model_{r:02d}-model_states.pt")[neox] for r in range(2)]
        else:
            copies = [torch.load(ckpt / f"mp_rank_{r:02d}_model_states.pt")["module"][f"sequential.2.{neox}"]
                      for r in range(2)]
        assert torch.allclose(copies[0] + copies[1], full[f"layers.0.{ours}"], atol=0, rtol=0)
    back = read_full_checkpoint(tmp_path)
    assert all(torch.equal(back.weights[k], full[k]) for k in full)


# --- the grouped-query order: recorded by Deepy, chosen by neox_qkv_order for GPT-NeoX's files ---------
ERA_ORDER = {"current": PER_RANK, "mid2024": PER_QUERY_HEAD}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("era", ["current", "mid2024"])
def test_every_wrong_qkv_order_is_refused_or_detected(tmp_path: Path, era: str, tp: int) -> None:
    """The same grouped-query files, as a GPT-NeoX checkpoint (nothing records the order) and as a
    Deepy one (format 3 = per_rank, 2 = per_query_head), read with every value of neox_qkv_order:
    the right order gives the source model; no choice is refused naming the key; a choice against a
    Deepy checkpoint's record is refused; the wrong choice on GPT-NeoX's files, which nothing can
    contradict, gives logits that differ by far more than any tolerance (so the key is honoured)."""
    config = config_of(LLAMA)
    full = source_weights(config)
    files = reference(config, full, tp, pipeline=False, era=era)
    truth = ERA_ORDER[era]
    base = NeoxNames.from_config(config)
    gpt_neox = write_neox_checkpoint(tmp_path / "neox", "global_step7", files, pipeline=False, tp=tp, iteration=7)
    fmt = next(f for f, order in GQA_ORDER_OF_FORMAT.items() if order == truth)
    for choice in (None, PER_RANK, PER_QUERY_HEAD):
        if choice is None:
            with pytest.raises(CheckpointError, match="set neox_qkv_order: per_rank .* or neox_qkv_order: "
                                                      "per_query_head"):
                gqa_order_for(base, None, choice, gpt_neox)
        else:
            shards, _ = neox_checkpoint_shards(gpt_neox, gqa_order_for(base, None, choice, gpt_neox))
            delta = float((logits(config, merge_tp_shards(config, shards)) - logits(config, full)).abs().max())
            assert delta <= 1e-5 if choice == truth else delta > 0.1, (choice, delta)
        if choice is not None and choice != truth:
            with pytest.raises(CheckpointError, match=f"neox_qkv_order: {choice}, but .* rows are {truth}"):
                gqa_order_for(base, fmt, choice, tmp_path)
        else:
            assert gqa_order_for(base, fmt, choice, tmp_path).gqa_order == truth
    # the Deepy checkpoint of those files (format recorded) reads right with no key at all
    deepy = write_neox_checkpoint(tmp_path / "deepy", "global_step7", files, pipeline=False, tp=tp, iteration=7)
    layout = {"tp": tp, "pp": 1, "dp": 1, "zero_stage": 0, "pipeline": False}
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
            "max_position_embeddings": 16, "padded_vocab_size": 256, "pos_emb": "rotary", **LLAMA}  # fmt: skip
    (deepy / "deepy_meta.json").write_text(json.dumps({"format": fmt, "iteration": 7, "layout": layout, "args": args}))
    (deepy / "COMMITTED").write_text(json.dumps({"step": 7, "kind": "step", "time": 0.0}))
    read = read_full_checkpoint(deepy)
    assert (logits(config, read.weights) - logits(config, full)).abs().max() <= 1e-5


def test_multi_head_attention_needs_no_order() -> None:
    names = NeoxNames.from_config(config_of(NEOX))
    assert gqa_order_for(names, None, None, Path("x")) == names


# --- what GPT-NeoX's loader and tools read besides the weights -----------------------------------------
def test_args_and_configs_are_what_gpt_neox_reads() -> None:
    """GPT-NeoX's save_ds_checkpoint (megatron/checkpointing.py, ea7aefd8) records exactly these eight
    args, and its load asserts each equals its own value: another key would stop it. configs/ holds
    every resolved value (overrides included), pipe_parallel_size even at Deepy's default 0 (GPT-NeoX's
    converter assumes a pipeline when the key is absent)."""
    from megatron.checkpointing.neox import config_files, neox_checkpoint_args
    from megatron.neox_arguments.arguments import NeoXArgs

    args = NeoXArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                    **LLAMA).model_dump(mode="json")  # fmt: skip
    args.update(padded_vocab_size=512, config_files={"model.yml": "num_layers: 2\n"}, iteration=5)
    assert neox_checkpoint_args(args) == {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": None,
        "make_vocab_size_divisible_by": 128, "padded_vocab_size": 512, "tokenizer_type": "GPT2BPETokenizer",
        "model_parallel_size": 1,
    }  # fmt: skip
    files = config_files(args)
    assert list(files) == ["resolved.yml"]
    values = yaml.safe_load(files["resolved.yml"])
    assert values["pipe_parallel_size"] == 0 and values["num_kv_heads"] == 2 and values["norm"] == "rmsnorm"
    assert "config_files" not in values and "iteration" not in values
    assert all(values[k] == v for k, v in args.items() if v is not None and k not in ("config_files", "iteration"))


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_names_read_from_a_checkpoints_record_match_the_models(arch: str) -> None:
    """A checkpoint records the arguments of the run that wrote it (``deepy_meta.json``); reading the
    layout facts from that record gives what the model's own config gives."""
    from megatron.neox_arguments.arguments import NeoXArgs

    spec = NEOX if arch == "neox" else LLAMA
    stored = NeoXArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, **spec).model_dump(mode="json")
    names = NeoxNames.from_stored(stored)
    assert names == NeoxNames.from_config(config_of(spec))
    assert (names.kv_heads, names.gated_mlp, names.rmsnorm) == ((4, False, False) if arch == "neox" else (2, True, True))


def test_the_format_written_is_the_current_order_and_the_launcher_knows_every_format() -> None:
    from megatron.checkpointing.neox.checks import _ORDER_OF_FORMAT
    from megatron.checkpointing.save_load import FORMAT_VERSION, READABLE_FORMATS

    assert GQA_ORDER_OF_FORMAT[FORMAT_VERSION] == PER_RANK and set(GQA_ORDER_OF_FORMAT) < set(READABLE_FORMATS)
    assert _ORDER_OF_FORMAT == GQA_ORDER_OF_FORMAT  # neox/checks.py's torch-free copy
