"""Qwen3 (``Qwen3ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's block with a per-head RMSNorm
on queries and keys (``use_qk_layernorm``; ``models/qwen3/modeling_qwen3.py:229-230``) and heads whose width is
config.json's ``head_dim``, not hidden_size / heads (``kv_channels``); and the Qwen2/Qwen3 presets.

References are transformers' own model, built here from a ``Qwen3Config`` (random weights, norm gains moved off
their ones so a dropped or misplaced one shows; nothing downloaded): its logits, its parameter count and its
greedy ``generate``; for the presets, transformers' model of the published sizes on the meta device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_class_checks import (CONFIG_KEYS, Imported, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_each_change_is_named, assert_generation_equals_transformers,
                             assert_preset_counts_as_published, assert_round_trip_at_tp2_pp2, hf_start_args,
                             imported_model, max_logit_diff, perturbed_model, save_with_tokenizer)
from megatron.errors import ConversionError
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.model import GPTConfig, num_parameters

# head_dim 24: not hidden / heads = 16, so a model built from hidden / heads cannot load the weights
SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                             bos_token_id=0, eos_token_id=0)  # fmt: skip


def qwen3_model(**changes: Any) -> Any:
    from transformers import Qwen3Config

    return perturbed_model(Qwen3Config(**{**SHAPE, **changes}), seed=7)


@pytest.fixture(scope="module")
def imported() -> Imported:
    theirs = qwen3_model(tie_word_embeddings=False)
    return (theirs, *imported_model(theirs))


def test_qwen3_imports_with_its_head_width_query_key_norms_and_logits(imported: Imported) -> None:
    theirs, config, ours = imported
    assert choose_architecture(config) == "Qwen3ForCausalLM"
    assert config.kv_channels == 24 and config.use_qk_layernorm and config.qk_norm_scope == "head"
    assert not config.use_bias_in_attn_linear and not config.use_bias_in_qkv and not config.use_bias_in_mlp
    names = dict(ours.named_parameters())
    assert names["layers.0.attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 24, 64)
    assert names["layers.0.attention.dense.weight"].shape == (64, 4 * 24)
    assert names["layers.0.attention.q_norm.weight"].shape == (24,)
    # parameter count: the registry's (kv_channels-wide heads, the per-head norms), the module's, transformers'
    tokens, want = assert_counts_and_logits_equal(theirs, config, ours)
    # the query/key norms matter: the same weights without them are another model
    plain = {k: v for k, v in ours.state_dict().items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert max_logit_diff(config.model_copy(update={"use_qk_layernorm": False}), plain, tokens, want) > 1e-3


def test_qwen3_greedy_generation_equals_transformers(imported: Imported) -> None:
    assert_generation_equals_transformers(imported)


def test_qwen3_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    # attention_bias: Qwen3's switch for all four attention projections (use_bias_in_attn_linear)
    source = save_with_tokenizer(qwen3_model(tie_word_embeddings=True, attention_bias=True), tmp_path / "qwen3")
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path, "Qwen3ForCausalLM",
                                        (*CONFIG_KEYS, "intermediate_size", "head_dim", "attention_bias", "hidden_act",
                                         "use_sliding_window", "layer_types"))  # fmt: skip
    assert "kv_channels: 24" in trip.written and "use_qk_layernorm: true" in trip.written
    # one training step on the imported weights (the query/key norms move too), exported again
    assert_a_trained_step_exports(trip.deepy, tmp_path, moved=["layers.1.attention.k_norm.weight"])


def test_qwen3_what_it_cannot_carry_is_refused_by_name() -> None:
    from transformers import Qwen3Config

    windowed = Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ConversionError, match="use_sliding_window"):
        gpt_config_from_hf(windowed)
    base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, kv_channels=24,
                                padded_vocab_size=128, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_qk_layernorm=True)
    assert choose_architecture(GPTConfig(**base)) == "Qwen3ForCausalLM"
    with pytest.raises(ConversionError, match="use_bias_in_mlp: true .Qwen3ForCausalLM's MLP has no biases"):
        choose_architecture(GPTConfig(**dict(base, use_bias_in_mlp=True)))
    with pytest.raises(ConversionError, match="use_qk_layernorm: true .MistralForCausalLM has no query/key norm"):
        choose_architecture(GPTConfig(**dict(base, sliding_window_width=8)))
    with pytest.raises(ConversionError, match="use_qk_layernorm: true .Qwen2ForCausalLM has no query/key norm"):
        choose_architecture(GPTConfig(**dict(base, use_bias_in_qkv=True, kv_channels=None)))
    # heads wider than hidden / heads have no Qwen2 or GPTNeoX form
    with pytest.raises(ConversionError, match="kv_channels: 24 with use_bias_in_qkv"):
        choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=False, use_bias_in_qkv=True)))
    with pytest.raises(ConversionError, match="kv_channels: 24 .GPTNeoXForCausalLM"):
        choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=False, norm="layernorm", activation="gelu")))


def test_initialize_from_hf_of_a_qwen3_directory_checks_its_head_width(tmp_path: Path) -> None:
    """The check before launch reads a Qwen3 config.json (plain JSON) and names kv_channels and use_qk_layernorm
    when a config would build another model."""
    from transformers import Qwen3Config

    model, args = hf_start_args(Qwen3Config(**SHAPE), tmp_path / "hf")
    assert (model["kv_channels"], model["use_qk_layernorm"], model["use_bias_in_attn_linear"]) == (24, True, False)
    assert_each_change_is_named(args, [("kv_channels", None), ("use_qk_layernorm", False)])


# published sizes (each model's config.json on the Hub); the count is transformers' own, of the model built from
# those sizes on the meta device
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2/qwen2-0.5B.yml": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                           tie_word_embeddings=True)),
    "qwen2/qwen2-7B.yml": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                         tie_word_embeddings=False)),
    "qwen3/qwen3-0.6B.yml": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                           head_dim=128, tie_word_embeddings=True)),
    "qwen3/qwen3-8B.yml": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, tie_word_embeddings=False)),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_qwen_presets_have_the_published_parameter_count(preset: str) -> None:
    from transformers import Qwen2Config, Qwen3Config

    family, sizes = PUBLISHED[preset]
    hf_config = (Qwen2Config if family == "qwen2" else Qwen3Config)(**sizes)
    ours, theirs = assert_preset_counts_as_published(preset, hf_config)
    assert choose_architecture(ours) == theirs


LEVANTER_QWEN = """\
data:
  train_urls: ["{root}/train.jsonl"]
  cache_dir: "{root}/cache"
  tokenizer: "{root}/tokenizer.json"
model:
  type: %s
  seq_len: 64
  hidden_dim: 64
  intermediate_dim: 96
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
%s
trainer:
  train_batch_size: 4
  num_train_steps: 10
optimizer:
  learning_rate: 1e-5
"""


@pytest.mark.parametrize("kind", ["qwen", "qwen3"])
def test_levanter_qwen_model_types_build_qwen2_and_qwen3(kind: str, tmp_path: Path) -> None:
    """Levanter's ``model.type: qwen`` (QwenConfig, src/levanter/models/qwen.py:35-139 at 9263f81e: q/k/v biases,
    none on o_proj) and ``qwen3`` (Qwen3Config, :299-376: per-head q/k RMSNorm, head_dim) build the model
    transformers' Qwen2/Qwen3 class computes, with Levanter's LlamaConfig defaults where the file says nothing."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config
    from test_dialects import levanter_args

    from megatron.errors import ConfigError

    extra = "  head_dim: 24\n  use_bias: false" if kind == "qwen3" else "  use_bias: false"
    args = levanter_args(tmp_path, LEVANTER_QWEN % (kind, extra)).args
    config = GPTConfig(**{k: getattr(args, k) for k in GPTConfig.model_fields if hasattr(args, k)}).with_vocab(128)
    sizes: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hf_config = Qwen3Config(**sizes, head_dim=24) if kind == "qwen3" else Qwen2Config(**sizes)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(hf_config)
    assert choose_architecture(config) == type(theirs).__name__
    assert num_parameters(config) == sum(p.numel() for p in theirs.parameters())
    # LlamaConfig's defaults (llama.py:59-77): RMSNorm eps 1e-5, rope theta 1e4, untied, silu gated MLP
    assert (config.rms_norm_epsilon, config.rotary_emb_base, config.no_weight_tying, config.activation) == (
        1e-5, 10000, True, "swiglu")
    defaults = levanter_args(tmp_path, LEVANTER_QWEN.replace("  seq_len: 64\n  hidden_dim: 64\n  intermediate_dim: 96\n"
                                                             "  num_layers: 2\n  num_heads: 4\n  num_kv_heads: 2\n",
                                                             "") % (kind, "")).args
    assert (defaults.hidden_size, defaults.intermediate_size, defaults.num_layers, defaults.seq_length) == (
        4096, 3 * 11008, 32, 2048)
    with pytest.raises(ConfigError, match="use_bias also gives its RMSNorms a bias"):
        levanter_args(tmp_path, LEVANTER_QWEN % (kind, "  use_bias: true"))
    if kind == "qwen":  # Levanter's Qwen raises NotImplementedError for a window (qwen.py:172-176)
        with pytest.raises(ConfigError, match="use_sliding_window"):
            levanter_args(tmp_path, LEVANTER_QWEN % (kind, "  use_sliding_window: true\n  sliding_window: 16"))
