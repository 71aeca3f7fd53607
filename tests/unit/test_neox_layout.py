"""GPT-NeoX's checkpoint layout against files written by test code from GPT-NeoX's published rules
(``tests/neox_reference_layout.py``): reading them gives the source model back (logits equal), and
Deepy's writer produces the same files, tensor for tensor, for pp0/pp>=1, tp1/tp2, GPT-NeoX and
Llama-style (rmsnorm, SwiGLU, grouped-query) models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from neox_reference_layout import neox_files, write_neox_checkpoint

from megatron.checkpointing.neox_files import neox_checkpoint_shards
from megatron.checkpointing.neox_layout import NeoxNames, qkv_from_neox, qkv_to_neox
from megatron.interop.deepy_checkpoint import merge_tp_shards, write_weights_only_checkpoint
from megatron.interop.hf_model import build_gpt_model
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTModel

NEOX = dict(norm="layernorm", activation="gelu", num_kv_heads=4, no_weight_tying=False, rotary_pct=0.25,
            use_bias_in_attn_linear=True, use_bias_in_mlp=True)  # fmt: skip
LLAMA = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, no_weight_tying=True, intermediate_size=96,
             use_bias_in_attn_linear=False, use_bias_in_mlp=False)  # fmt: skip


def config_of(arch: dict, seed: int = 1234) -> GPTConfig:
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


CASES = [(arch, tp, pipeline) for arch in ("neox", "llama") for tp in (1, 2) for pipeline in (False, True)]


@pytest.mark.parametrize(("arch", "tp", "pipeline"), CASES)
def test_gpt_neox_layout_reads_back_to_the_same_model(tmp_path: Path, arch: str, tp: int, pipeline: bool) -> None:
    config = config_of(NEOX if arch == "neox" else LLAMA)
    full = source_weights(config)
    files = neox_files(full, num_layers=2, heads=4, kv_heads=config.kv_heads, tp=tp, pipeline=pipeline,
                       llama=arch == "llama")
    tag = write_neox_checkpoint(tmp_path, "global_step7", files, pipeline=pipeline, tp=tp, iteration=7)
    shards, found_tp = neox_checkpoint_shards(tag, NeoxNames.from_config(config))
    read = merge_tp_shards(config, shards)
    assert found_tp == tp and set(read) == set(full)
    diff = (logits(config, read) - logits(config, full)).abs().max()
    assert diff <= 1e-5


@pytest.mark.parametrize(("arch", "tp", "pipeline"), CASES)
def test_deepy_writes_gpt_neox_files_key_by_key(tmp_path: Path, arch: str, tp: int, pipeline: bool) -> None:
    """The converter's writer (the engine's translation, offline) against the reference files."""
    config = config_of(NEOX if arch == "neox" else LLAMA)
    full = source_weights(config)
    want = neox_files(full, num_layers=2, heads=4, kv_heads=config.kv_heads, tp=tp, pipeline=pipeline,
                      llama=arch == "llama")
    ckpt = write_weights_only_checkpoint(tmp_path, config=config, weights=full, tp=tp, pp=1 if pipeline else 0,
                                         args={})
    pattern = "layer_*-model_states.pt" if pipeline else "mp_rank_*_model_states.pt"
    assert sorted(p.name for p in ckpt.glob(pattern)) == sorted(want)
    for name, tensors in want.items():
        got = torch.load(ckpt / name, weights_only=True)
        got = got if pipeline else got["module"]
        assert sorted(got) == sorted(tensors), name
        for key, tensor in tensors.items():
            assert torch.equal(got[key], tensor), f"{name}: {key}"


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (2, 1)])
def test_qkv_order_round_trips(heads: int, kv_heads: int) -> None:
    t = torch.randn((heads + 2 * kv_heads) * 8, 5)
    neox = qkv_to_neox(t, heads, kv_heads)
    assert not torch.equal(neox, t) or kv_heads == heads == 1
    assert torch.equal(qkv_from_neox(neox, heads, kv_heads), t)


@pytest.mark.parametrize("pipeline", [False, True])
def test_parallel_residual_row_biases_sum_over_tp_ranks(tmp_path: Path, pipeline: bool) -> None:
    """With gpt_j_residual GPT-NeoX adds every rank's copy of a row-parallel bias before the
    all-reduce: the copies in the files sum to the model's bias, and read back to it."""
    from megatron.interop.deepy_checkpoint import read_full_checkpoint

    config = config_of({**NEOX, "gpt_j_residual": True})
    full = source_weights(config)
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
            "max_position_embeddings": 16, "padded_vocab_size": 256, "pos_emb": "rotary", "seed": 1234, **NEOX,
            "gpt_j_residual": True}  # fmt: skip
    ckpt = write_weights_only_checkpoint(tmp_path, config=config, weights=full, tp=2, pp=1 if pipeline else 0,
                                         args=args)
    for name in ("attention.dense.bias", "mlp.dense_4h_to_h.bias"):
        if pipeline:
            copies = [torch.load(ckpt / f"layer_02-model_{r:02d}-model_states.pt")[name] for r in range(2)]
        else:
            copies = [torch.load(ckpt / f"mp_rank_{r:02d}_model_states.pt")["module"][f"sequential.2.{name}"]
                      for r in range(2)]
        assert torch.allclose(copies[0] + copies[1], full[f"layers.0.{name}"], atol=0, rtol=0)
    back = read_full_checkpoint(tmp_path)
    assert all(torch.equal(back.weights[k], full[k]) for k in full)


def test_config_files_keep_their_names_as_gpt_neox_writes_them() -> None:
    from megatron.checkpointing.save_load import config_file_names

    files = {"configs/model.yml": "a", "runs/x/local.yml": "b", "other/local.yml": "c"}
    assert config_file_names(files) == {"model.yml": "a", "01_local.yml": "c", "02_local.yml": "b"}


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
