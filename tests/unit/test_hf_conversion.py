"""Hugging Face export/import and GPT-NeoX checkpoint import, in one process (no DeepSpeed launch).

Every parity check here loads the written directory with ``transformers`` itself and compares
its logits with our ``GPTModel`` in the test, not through the converter's own verification.
Models are random (norm gains and biases too, so a dropped or misplaced parameter shows), built
from configs in the test: nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt_configs import gpt_config

from megatron.errors import ConfigError, ConversionError
from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.deepy_checkpoint import (
    read_full_checkpoint,
    write_weights_only_checkpoint,
)
from megatron.interop.hf_config import SpecialTokens, choose_architecture, gpt_config_from_hf, hf_config_from_gpt
from megatron.interop.hf_model import fixed_batch, save_hf_model
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer
from megatron.interop.hf_weights import to_hf_state_dict
from megatron.model import GPTConfig, GPTModel
from megatron.model.pipeline import (
    is_pipeline_parameter_name,
    model_parameter_name,
    pipeline_location,
    pipeline_parameter_name,
)

REPO = Path(__file__).resolve().parents[2]
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48, padded_vocab_size=128, seed=3,
            pos_emb="rotary")  # fmt: skip
NEOX = dict(BASE, norm="layernorm", activation="gelu", rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True)
LLAMA = dict(BASE, norm="rmsnorm", activation="swiglu", num_kv_heads=2, intermediate_size=96, no_weight_tying=True,
             use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1e-6)  # fmt: skip

VARIANTS = {
    "neox_partial_rotary_parallel_untied": NEOX,
    "neox_tied_sequential_no_mlp_or_norm_bias": dict(NEOX, gpt_j_residual=False, no_weight_tying=False,
                                                     use_bias_in_mlp=False, use_bias_in_norms=False, rotary_pct=1.0),
    "neox_shared_norm_relu": dict(NEOX, gpt_j_tied=True, activation="relu", use_bias_in_attn_linear=False),
    "llama_gqa_swiglu_untied": LLAMA,
    "llama_tied_geglu_with_biases": dict(LLAMA, activation="geglu", no_weight_tying=False, num_kv_heads=4,
                                         use_bias_in_attn_linear=True, use_bias_in_mlp=True),
    "mistral_sliding_window": dict(LLAMA, sliding_window_width=7),
}


def random_weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    """The model's init, with every norm gain and bias randomised too (they start as ones/zeros)."""
    gen = torch.Generator().manual_seed(11)
    weights = {}
    for name, tensor in GPTModel(config).state_dict().items():
        if "norm" in name or name.endswith("bias"):
            tensor = tensor + 0.2 * torch.randn(tensor.shape, generator=gen)
        weights[name] = tensor.clone()
    return weights


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def our_logits(config: GPTConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    model = GPTModel(config).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(tokens)


# --- architecture choice ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, arch",
    [
        (NEOX, "GPTNeoXForCausalLM"),
        (LLAMA, "LlamaForCausalLM"),
        (dict(LLAMA, sliding_window_width=16), "MistralForCausalLM"),
    ],
)
def test_architecture_follows_the_config(changes: dict, arch: str) -> None:
    assert choose_architecture(GPTConfig(**changes)) == arch


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(NEOX, pos_emb="alibi"), "pos_emb: alibi"),
        (dict(NEOX, pos_emb="learned"), "pos_emb: learned"),
        (dict(NEOX, pos_emb="rpe"), "pos_emb: rpe"),
        (dict(NEOX, norm="scalenorm"), "norm: scalenorm"),
        (dict(NEOX, use_qk_layernorm=True), "use_qk_layernorm"),
        (dict(NEOX, num_kv_heads=2), "num_kv_heads: 2"),
        (dict(NEOX, activation="swiglu"), "activation: swiglu"),
        (dict(NEOX, activation="softsign"), "activation: softsign"),
        (dict(LLAMA, activation="gelu"), "activation: gelu"),
        (dict(LLAMA, gpt_j_residual=True), "gpt_j_residual"),
        (dict(LLAMA, rotary_pct=0.5), "rotary_pct: 0.5"),
        (dict(LLAMA, sliding_window_width=8, use_bias_in_mlp=True), "MistralForCausalLM has no biases"),
        (dict(LLAMA, sliding_window_width=8, attention_config=[[["local", "global"], 1]]), "mixes sliding-window"),
        (dict(NEOX, sliding_window_width=8), "sliding_window_width: 8"),
        (dict(NEOX, value_head=True), "value_head"),
    ],
)
def test_features_without_an_hf_equivalent_are_refused_by_name(changes: dict, named: str) -> None:
    with pytest.raises(ConversionError, match="no faithful Hugging Face") as err:
        choose_architecture(gpt_config(**changes))
    assert named in str(err.value)


# --- export parity: transformers loads what we wrote --------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exported_model_computes_our_logits(tmp_path: Path, variant: str) -> None:
    config = GPTConfig(**VARIANTS[variant])
    weights = random_weights(config)
    arch = choose_architecture(config)
    hf_config = hf_config_from_gpt(config, SpecialTokens(0, 0, 1), torch.float32)
    save_hf_model(hf_config, to_hf_state_dict(config, arch, weights), tmp_path, torch.float32)

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [arch]
    assert written["vocab_size"] == config.padded_vocab_size
    assert written["intermediate_size"] == config.ffn_hidden_size
    assert written["tie_word_embeddings"] == (not config.no_weight_tying)
    tokens = fixed_batch(config.padded_vocab_size, 40)  # longer than the sliding window
    delta = (our_logits(config, weights, tokens) - hf_logits(tmp_path, tokens)).abs().max().item()
    assert delta <= 1e-4, delta
    # and the HF config maps back to the same architecture (gpt_j_tied and missing biases excepted:
    # transformers has two norms and always-present biases, filled with a copy / zeros)
    if variant in ("neox_partial_rotary_parallel_untied", "llama_gqa_swiglu_untied", "mistral_sliding_window"):
        back = gpt_config_from_hf(hf_config, config.seq_length)
        assert back.ffn_hidden_size == config.ffn_hidden_size
        assert back.max_positions == config.max_positions  # HF always writes the table size; ours may leave it to seq_length
        same = dict(seed=config.seed, init_method_std=config.init_method_std, intermediate_size=config.intermediate_size,
                    max_position_embeddings=config.max_position_embeddings)  # fmt: skip
        assert back.replace(**same) == config


def test_a_wrong_layout_fails_parity(tmp_path: Path) -> None:
    """The comparison above can fail: an HF window one token short changes the logits."""
    config = GPTConfig(**VARIANTS["mistral_sliding_window"])
    weights = random_weights(config)
    hf_config = hf_config_from_gpt(config, SpecialTokens(0, 0, None), torch.float32)
    hf_config.sliding_window = config.sliding_window_width  # ours counts the window without the token itself
    save_hf_model(hf_config, to_hf_state_dict(config, choose_architecture(config), weights), tmp_path, torch.float32)
    tokens = fixed_batch(config.padded_vocab_size, 40)
    assert (our_logits(config, weights, tokens) - hf_logits(tmp_path, tokens)).abs().max().item() > 1e-3


# --- weights-only checkpoints at any tp/pp --------------------------------------------------------------
def test_pipeline_location_inverts_model_parameter_name() -> None:
    for changes in (NEOX, LLAMA, dict(NEOX, pos_emb="learned", no_weight_tying=False)):
        config = GPTConfig(**changes)
        for name in GPTModel(config).state_dict():
            index, local = pipeline_location(name, config.num_layers)
            assert model_parameter_name(f"{index}.{local}") == name
            # the name map a pipeline <-> plain resume links universal checkpoints by
            for tied in (True, False):
                pipe = pipeline_parameter_name(name, config.num_layers, tied)
                assert is_pipeline_parameter_name(pipe) and not is_pipeline_parameter_name(name)
                assert model_parameter_name(pipe) == name


@pytest.mark.parametrize("tp, pp", [(1, 0), (2, 0), (2, 2), (1, 1)])
def test_written_checkpoint_reads_back_equal(tmp_path: Path, tp: int, pp: int) -> None:
    config = GPTConfig(**LLAMA)
    weights = random_weights(config)
    args = {"padded_vocab_size": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
            "seq_length": 48, "pos_emb": "rotary", "norm": "rmsnorm", "activation": "swiglu", "intermediate_size": 96,
            "no_weight_tying": True, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False,
            "rms_norm_epsilon": 1e-6, "seed": 3}  # fmt: skip
    ckpt = write_weights_only_checkpoint(tmp_path, config=config, weights=weights, tp=tp, pp=pp, step=7, args=args)
    assert (ckpt / "COMMITTED").exists() and (tmp_path / "latest").read_text().strip() == "global_step7"
    meta = json.loads((ckpt / "deepy_meta.json").read_text())
    assert meta["weights_only"] is True and meta["layout"]["tp"] == tp and meta["layout"]["pipeline"] == (pp >= 1)
    back = read_full_checkpoint(tmp_path)
    assert back.iteration == 7 and back.config == config
    assert set(back.weights) == set(weights)
    assert all(torch.equal(back.weights[k], weights[k]) for k in weights)
    if tp == 2:  # each rank holds its own query heads and the kv head they read
        # (in GPT-NeoX's current layout: block 0 is layer 2; grouped-query rows are the rank's [Q; K; V])
        shard = torch.load(ckpt / ("mp_rank_01_model_states.pt" if pp == 0 else "layer_02-model_01-model_states.pt"),
                           weights_only=True)  # fmt: skip
        qkv = shard["module"]["sequential.2.attention.query_key_value.weight"] if pp == 0 else shard[
            "attention.query_key_value.weight"]
        full = weights["layers.0.attention.query_key_value.weight"]
        rows = [full[32:64], full[80:96], full[112:128]]
        assert torch.equal(qkv, torch.cat(rows))


# --- round trips through transformers -------------------------------------------------------------------
def make_hf_model(tmp: Path, kind: str) -> Path:
    """A random transformers model saved with a byte-level tokenizer, as a user's HF directory would be."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

    if kind == "gpt_neox":
        config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=160, hidden_act="gelu", max_position_embeddings=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5},
                               use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    else:
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start as ones/zeros: make them count
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    out = tmp / kind
    model.save_pretrained(out)
    export_tokenizer(TokenizerFiles("CharLevelTokenizer"), out, 64)
    return out


@pytest.mark.parametrize("kind", ["gpt_neox", "llama"])
def test_hf_to_ours_to_hf_is_identical(tmp_path: Path, kind: str) -> None:
    source = make_hf_model(tmp_path, kind)
    imported = import_to_deepy(source, tmp_path / "deepy", tp=2, pp=2)
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-4
    assert imported.iteration == 0
    text = imported.config_file.read_text()
    assert "model_parallel_size: 2" in text and "finetune: true" in text
    assert "tokenizer_type: CharLevelTokenizer" in text  # the byte tokenizer was recognised as ours

    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back")
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= 1e-4
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back)
    assert all(torch.equal(original[k], back[k]) for k in original)
    config_a = json.loads((source / "config.json").read_text())
    config_b = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                "rope_parameters", "tie_word_embeddings", "max_position_embeddings", "hidden_act", "eos_token_id",
                "num_key_value_heads", "rms_norm_eps", "use_parallel_residual", "layer_norm_eps"):  # fmt: skip
        assert config_a.get(key) == config_b.get(key), key


def test_bf16_export_writes_bf16_and_still_verifies(tmp_path: Path) -> None:
    config = GPTConfig(**LLAMA)
    weights = random_weights(config)
    args = {"padded_vocab_size": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
            "seq_length": 48, "pos_emb": "rotary", "norm": "rmsnorm", "activation": "swiglu", "intermediate_size": 96,
            "no_weight_tying": True, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False,
            "rms_norm_epsilon": 1e-6, "tokenizer_type": "CharLevelTokenizer", "precision": "fp32"}  # fmt: skip
    write_weights_only_checkpoint(tmp_path / "ckpt", config=config, weights=weights, tp=2, pp=0, args=args)
    report = export_to_hf(tmp_path / "ckpt", tmp_path / "hf", precision="bf16", tokenizer=False)
    assert report.dtype == torch.bfloat16 and report.max_logit_diff is not None
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (tmp_path / "hf" / "tokenizer.json").exists()


def test_import_refuses_what_deepy_cannot_run(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=32,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                          "long_factor": [2.0] * 4, "original_max_position_embeddings": 16})  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "scaled")
    with pytest.raises(ConversionError, match="'longrope' is not supported"):
        import_to_deepy(tmp_path / "scaled", tmp_path / "out")


# --- GPT-NeoX (DeeperSpeed) checkpoints -------------------------------------------------------------------
NEOX_YML = """\
# a GPT-NeoX config as its runs write them (hyphenated keys)
{
  "num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64, "max-position-embeddings": 64,
  "pos-emb": "rotary", "rotary-pct": 0.5, "norm": "layernorm", "gpt-j-residual": {gpt_j}, "no-weight-tying": true,
  "model-parallel-size": 2, "pipe-parallel-size": {pp}, "tokenizer-type": "CharLevelTokenizer",
  "make-vocab-size-divisible-by": 128, "train-batch-size": 16, "precision": "fp32",
}
"""


def write_gpt_neox_fixture(root: Path, hf_dir: Path, *, pipeline: bool, gpt_j: bool, step: int = 20) -> Path:
    """A GPT-NeoX checkpoint at tp=2 holding the weights of the transformers GPTNeoX model in ``hf_dir``.

    Written from the format's facts, independently of the converter: per-head [q; k; v] rows split
    by head across ranks, row-parallel weights split on dim 1, norms replicated. Row-parallel biases:
    with the GPT-J residual each rank adds its copy before the all-reduce, so each holds half the
    bias; without it every rank holds the whole bias.
    """
    sd = load_file(hf_dir / "model.safetensors")
    tp, layers = 2, 2
    tag = root / f"global_step{step}"
    (tag / "configs").mkdir(parents=True)
    (tag / "configs" / "neox.yml").write_text(
        NEOX_YML.replace("{gpt_j}", str(gpt_j).lower()).replace("{pp}", "1" if pipeline else "0"))
    (root / "latest").write_text(f"global_step{step}")

    def split(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [c.clone() for c in t.chunk(tp, dim=dim)]

    per_layer: dict[int, list[dict[str, torch.Tensor]]] = {}
    per_layer[0] = [{"word_embeddings.weight": w} for w in split(sd["gpt_neox.embed_in.weight"], 0)]
    for i in range(layers):
        src = f"gpt_neox.layers.{i}."
        ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name in ("input_layernorm", "post_attention_layernorm"):
            for field in ("weight", "bias"):
                for r in range(tp):
                    ranks[r][f"{name}.{field}"] = sd[f"{src}{name}.{field}"].clone()
        for name, dim in (("attention.query_key_value", 0), ("mlp.dense_h_to_4h", 0)):
            for field in ("weight", "bias"):
                for r, part in enumerate(split(sd[f"{src}{name}.{field}"], dim)):
                    ranks[r][f"{name}.{field}"] = part
        for name in ("attention.dense", "mlp.dense_4h_to_h"):
            for r, part in enumerate(split(sd[f"{src}{name}.weight"], 1)):
                ranks[r][f"{name}.weight"] = part
                bias = sd[f"{src}{name}.bias"]
                ranks[r][f"{name}.bias"] = bias / tp if gpt_j else bias.clone()
            for r in range(tp):
                ranks[r]["attention.rotary_emb.inv_freq"] = torch.ones(4)  # saved by GPT-NeoX, ignored
        per_layer[i + 2] = ranks
    per_layer[layers + 3] = [{"norm.weight": sd["gpt_neox.final_layer_norm.weight"].clone(),
                              "norm.bias": sd["gpt_neox.final_layer_norm.bias"].clone()} for _ in range(tp)]
    head = sd["embed_out.weight"] if "embed_out.weight" in sd else sd["lm_head.weight"]  # transformers' file name
    per_layer[layers + 4] = [{"final_linear.weight": w} for w in split(head, 0)]

    client = {"iteration": step, "args": {"num_layers": layers, "model_parallel_size": tp},
              "np_rng_state": np.random.get_state(), "random_rng_state": (3, tuple(range(5)), None)}  # fmt: skip
    if pipeline:
        for index, ranks in per_layer.items():
            for r, state in enumerate(ranks):
                torch.save(state, tag / f"layer_{index:02d}-model_{r:02d}-model_states.pt")
        for mp in range(tp):
            torch.save({**client, "module": None}, tag / f"mp_rank_{mp:02d}_model_states.pt")
    else:
        for r in range(tp):
            module = {f"sequential.{index}.{name}": t
                      for index, ranks in per_layer.items() for name, t in ranks[r].items()}  # fmt: skip
            torch.save({**client, "module": module}, tag / f"mp_rank_{r:02d}_model_states.pt")
    return root


@pytest.mark.parametrize("pipeline, gpt_j", [(True, True), (False, False)])
def test_gpt_neox_checkpoint_converts_and_matches_transformers(tmp_path: Path, pipeline: bool, gpt_j: bool) -> None:
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    hf_config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=256, hidden_act="gelu", max_position_embeddings=64,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5},
                              use_parallel_residual=gpt_j, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(9)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "hf")
    neox = write_gpt_neox_fixture(tmp_path / "neox", tmp_path / "hf", pipeline=pipeline, gpt_j=gpt_j)

    report = import_to_deepy(neox, tmp_path / "deepy", tp=1, pp=0)
    assert report.kind == "gpt-neox" and report.iteration == 20
    text = report.config_file.read_text()
    assert "finetune: false" in text and f"gpt_j_residual: {str(gpt_j).lower()}" in text
    ours = read_full_checkpoint(tmp_path / "deepy")
    meta = json.loads((report.checkpoint / "deepy_meta.json").read_text())
    assert meta["iteration"] == 20 and meta["consumed_samples"] == 20 * 16

    tokens = fixed_batch(512, 48)
    delta = (our_logits(ours.config, ours.weights, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max().item()
    assert delta <= 1e-4, delta


def test_gpt_neox_features_outside_the_checked_set_are_refused(tmp_path: Path) -> None:
    tag = tmp_path / "neox" / "global_step1"
    (tag / "configs").mkdir(parents=True)
    (tag / "configs" / "c.yml").write_text('{"num-layers": 2, "num-attention-heads": 4, "pos-emb": "alibi", '
                                           '"norm": "rmsnorm", "num-kv-heads": 2}')  # fmt: skip
    torch.save({"module": None}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(ConversionError) as err:
        import_to_deepy(tmp_path / "neox", tmp_path / "out")
    assert "pos_emb: alibi" in str(err.value)
    assert "norm:" not in str(err.value)  # rmsnorm and grouped-query models are read (tests/unit/test_neox_loading.py)


# --- tokenizers -------------------------------------------------------------------------------------------
def test_exported_tokenizers_encode_like_ours(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megatron.interop.hf_tokenizer import SAMPLE_TEXTS, build_tokenizer_from_files

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([*SAMPLE_TEXTS, *(REPO / "README.md").read_text().splitlines()], trainer)
    bpe.save(str(tmp_path / "bpe.json"))
    # a tiktoken ranks file: every byte, then merges (rank order = merge order)
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"an", b" an", b"ce", b"ent"]
    ranks = [bytes([b]) for b in range(256)] + merges
    (tmp_path / "tiny.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    for files in (TokenizerFiles("CharLevelTokenizer"), TokenizerFiles("HFTokenizer", str(tmp_path / "bpe.json")),
                  TokenizerFiles("TiktokenTokenizer", str(tmp_path / "tiny.tiktoken"))):  # fmt: skip
        out = tmp_path / files.tokenizer_type
        tokens = export_tokenizer(files, out, 128)
        ours = build_tokenizer_from_files(files)
        theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert theirs.eos_token_id == tokens.eos == ours.eod
        text = "Tokenizers must agree, même en français 🙂\n\n"
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
        assert theirs.decode(ours.tokenize(text)) == ours.detokenize(ours.tokenize(text))


def test_a_tokenizer_that_would_change_ids_is_refused(tmp_path: Path) -> None:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    lines = ["hello world, a sentencepiece test", "def f(x):  return  x * 2", "números 12345"]
    corpus.write_text("\n".join(lines * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   hard_vocab_limit=False, minloglevel=2)  # fmt: skip
    # SentencePiece's default normaliser folds runs of spaces; the HF conversion keeps them
    with pytest.raises(ConversionError, match="encodes .* differently"):
        export_tokenizer(TokenizerFiles("SPMTokenizer", str(tmp_path / "sp.model")), tmp_path / "out", 64)


# --- the command-line tools ---------------------------------------------------------------------------------
def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "tools" / "ckpts" / name), *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)  # fmt: skip


@pytest.mark.parametrize("tool", ["convert_neox_to_hf.py", "convert_hf_to_neox.py"])
def test_tools_have_help(tool: str) -> None:
    proc = run_tool(tool, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--precision" in proc.stdout and "--verify" in proc.stdout


def test_export_tool_refuses_alibi_with_one_message(tmp_path: Path) -> None:
    config = GPTConfig(**dict(NEOX, pos_emb="alibi"))
    args = {"padded_vocab_size": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 48,
            "pos_emb": "alibi", "gpt_j_residual": True, "no_weight_tying": True, "tokenizer_type": "CharLevelTokenizer"}
    weights = random_weights(config)
    write_weights_only_checkpoint(tmp_path / "ckpt", config=config, weights=weights, tp=1, pp=0, args=args)
    proc = run_tool("convert_neox_to_hf.py", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pos_emb: alibi" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "hf").exists()  # refused before writing anything

    missing = run_tool("convert_hf_to_neox.py", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "neither a Hugging Face model directory" in missing.stderr


def test_hf_model_without_tokenizer_files_round_trips_with_no_tokenizer(tmp_path: Path) -> None:
    """An HF directory with weights and config only: the import records no tokenizer, the export with
    ``tokenizer=False`` writes the same tensors back (and without it says what to pass)."""
    source = make_hf_model(tmp_path, "gpt_neox")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (source / name).unlink(missing_ok=True)
    import_to_deepy(source, tmp_path / "deepy", tp=1, pp=0)
    with pytest.raises(ConversionError, match="records no tokenizer.*--no-tokenizer"):
        export_to_hf(tmp_path / "deepy", tmp_path / "refused")
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back", tokenizer=False)
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= 1e-4
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
    assert not (tmp_path / "back" / "tokenizer.json").exists()


def test_generate_runs_on_the_imported_model_config_alone(tmp_path: Path) -> None:
    """``deepy_model.yml`` (written by the import) describes the model only: generate.py's checks
    accept it, filling in (and saying) the training keys inference does not read; train.py still
    refuses it for them."""
    from megatron.app.deepy import DeepyCommand, resolve

    imported = import_to_deepy(make_hf_model(tmp_path, "gpt_neox"), tmp_path / "deepy", tp=1, pp=0, verify=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    overrides = ["text_gen_type=input-file", f"sample_input_file={prompts}"]
    resolved = resolve(DeepyCommand(str(REPO / "generate.py"), [str(imported.config_file)], overrides))
    assert (resolved.args.train_micro_batch_size_per_gpu, resolved.args.lr, resolved.args.train_iters) == (1, 0.0, 1)
    assert any("generate.py does not train: filled in" in w for w in resolved.warnings), resolved.warnings
    with pytest.raises(ConfigError, match="no learning rate") as err:
        resolve(DeepyCommand(str(REPO / "train.py"), [str(imported.config_file)], []))
    assert "no training data" in str(err.value)
