"""OLMo 2 (``Olmo2ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's block with its norms after
attention and the MLP instead of before (``norm_placement: post``; ``models/olmo2/modeling_olmo2.py:297-314``) and
RMSNorm over the whole query and key projections (``qk_norm_scope: projection``; ``:213-228``).

References are transformers' own model, built here from an ``Olmo2Config`` (random weights, norm gains and biases
moved off their ones/zeros so a dropped or misplaced one shows; nothing downloaded): its logits, its parameter count
and its greedy ``generate``. The logit comparisons run both models in the test, not through the converter's
built-in check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_class_checks import (CONFIG_KEYS, Imported, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_each_change_is_named, assert_generation_equals_transformers,
                             assert_preset_counts_as_published, assert_round_trip_at_tp2_pp2, hf_start_args,
                             imported_model, perturbed_model, save_with_tokenizer)
from megatron.errors import ConfigError, ConversionError
from megatron.interop.hf_config import choose_architecture
from megatron.model import GPTConfig, num_parameters

# grouped-query (k_norm narrower than q_norm), OLMo 2's rms_norm_eps and rope theta (configuration_olmo2.py:88)
SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             pad_token_id=1, bos_token_id=None, eos_token_id=0)  # fmt: skip


def olmo2_model(tied: bool, **changes: Any) -> Any:
    from transformers import Olmo2Config

    return perturbed_model(Olmo2Config(**SHAPE, tie_word_embeddings=tied, **changes), seed=7)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def imported(request: pytest.FixtureRequest) -> Imported:
    theirs = olmo2_model(tied=request.param)
    return (theirs, *imported_model(theirs))


def test_olmo2_imports_with_its_post_norms_and_logits(imported: Imported) -> None:
    theirs, config, ours = imported
    assert choose_architecture(config) == "Olmo2ForCausalLM"
    assert (config.norm_placement, config.use_qk_layernorm, config.qk_norm_scope) == ("post", True, "projection")
    names = dict(ours.named_parameters())
    assert "layers.0.input_layernorm.weight" not in names and "layers.0.attention_output_norm.weight" in names
    assert names["layers.0.attention.k_norm.weight"].shape == (2 * 16,)  # kv heads x head_dim
    # parameter count: the registry's (post: two norms a block; the q/k norms over the projections), the module's,
    # transformers'
    assert_counts_and_logits_equal(theirs, config, ours)


def test_olmo2_greedy_generation_equals_transformers(imported: Imported) -> None:
    assert_generation_equals_transformers(imported)


def test_olmo2_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    source = save_with_tokenizer(olmo2_model(tied=False, attention_bias=True), tmp_path / "olmo2")
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path, "Olmo2ForCausalLM",
                                        (*CONFIG_KEYS, "intermediate_size", "hidden_act", "attention_bias"))
    assert "norm_placement: post" in trip.written and "qk_norm_scope: projection" in trip.written, trip.written
    # one training step on the imported weights (every weight moves, the sharded q/k norm gains included), exported
    assert_a_trained_step_exports(trip.deepy, tmp_path,
                                  moved=["layers.1.attention.q_norm.weight", "layers.1.mlp_output_norm.weight"])


def test_olmo2_what_it_cannot_carry_is_refused_by_name() -> None:
    base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                padded_vocab_size=128, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                use_bias_in_attn_linear=False, use_bias_in_mlp=False, norm_placement="post",
                                use_qk_layernorm=True, qk_norm_scope="projection")
    assert choose_architecture(GPTConfig(**base)) == "Olmo2ForCausalLM"
    with pytest.raises(ConversionError, match="use_bias_in_mlp: true .Olmo2ForCausalLM"):
        choose_architecture(GPTConfig(**dict(base, use_bias_in_mlp=True)))
    with pytest.raises(ConversionError, match="sliding_window_width: 8 .Olmo2ForCausalLM"):
        choose_architecture(GPTConfig(**dict(base, sliding_window_width=8)))
    # the pieces alone have no HF class: Llama would silently drop them
    with pytest.raises(ConversionError, match="norm_placement: post .GPTNeoX, Llama and Mistral"):
        choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=False, qk_norm_scope="head")))
    with pytest.raises(ConversionError, match="qk_norm_scope: projection .only Olmo2ForCausalLM"):
        choose_architecture(GPTConfig(**dict(base, norm_placement="pre")))
    with pytest.raises(ConversionError, match="norm_placement: sandwich"):
        choose_architecture(GPTConfig(**dict(base, norm_placement="sandwich", use_qk_layernorm=False,
                                             qk_norm_scope="head")))


def test_initialize_from_hf_of_an_olmo2_directory_checks_its_norms(tmp_path: Path) -> None:
    """The check before launch reads an OLMo 2 config.json (plain JSON) and names norm_placement and
    qk_norm_scope when a config would build Llama's pre-norm block or per-head q/k norms instead."""
    from transformers import Olmo2Config

    model, args = hf_start_args(Olmo2Config(**SHAPE), tmp_path / "hf")
    assert (model["norm_placement"], model["qk_norm_scope"], model["use_qk_layernorm"]) == ("post", "projection", True)
    assert_each_change_is_named(args, [("norm_placement", "pre"), ("qk_norm_scope", "head")])


# published sizes (each model's config.json on the Hub); the count is transformers' own, of the model built from
# those sizes on the meta device
PUBLISHED: dict[str, dict[str, Any]] = {
    "olmo2/olmo2-1B.yml": dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False),
    "olmo2/olmo2-7B.yml": dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_olmo2_presets_have_the_published_parameter_count(preset: str) -> None:
    from transformers import Olmo2Config

    ours, _ = assert_preset_counts_as_published(preset, Olmo2Config(**PUBLISHED[preset]))
    assert choose_architecture(ours) == "Olmo2ForCausalLM"


LEVANTER_OLMO2 = """\
data:
  train_urls: ["{root}/train.jsonl"]
  cache_dir: "{root}/cache"
  tokenizer: "{root}/tokenizer.json"
model:  # olmo2_sft.yaml's model section (Levanter 9263f81e config/olmo2_sft.yaml), smaller
  type: olmo2
  seq_len: 64
  hidden_dim: 64
  intermediate_dim: 96
  num_layers: 2
  num_heads: 4
  num_kv_heads: 4
  use_bias: false
  use_layer_norm_weight: true
  layer_norm_epsilon: 1e-6
  activation_function: "silu"
  attention_bias: {attention_bias}
  upcast_attn: True
  rope:
    type: "default"
    theta: 500000
trainer:
  train_batch_size: 4
  num_train_steps: 10
optimizer:
  learning_rate: 1e-5
"""


def test_levanter_olmo2_model_is_olmo2s_block(tmp_path: Path) -> None:
    """Levanter's ``model.type: olmo2`` (Olmo2Config, src/levanter/models/olmo.py at 9263f81e) builds OLMo 2's
    block: post-norms, whole-projection q/k norms, attention_bias on the attention alone; its parameter count is
    Levanter's own formula (Olmo2Config.total_trainable_params, olmo.py:171-215, exact for equal q and kv heads)."""
    from test_dialects import levanter_args

    from megatron.model.config import GPTConfig as Config

    args = levanter_args(tmp_path, LEVANTER_OLMO2.replace("{attention_bias}", "true")).args
    assert (args.norm_placement, args.use_qk_layernorm, args.qk_norm_scope, args.norm) == (
        "post", True, "projection", "rmsnorm")
    assert (args.use_bias_in_attn_linear, args.use_bias_in_mlp, args.rotary_emb_base) == (True, False, 500000)
    vocab, hidden, inter, layers = 128, 64, 96, 2  # the vocabulary is the tokenizer's, known at launch
    fields = {k: getattr(args, k) for k in Config.model_fields if hasattr(args, k)}
    config = Config(**{**fields, "padded_vocab_size": vocab})
    attn = 4 * hidden * hidden + (3 * hidden + hidden)  # q, k, v, o and their biases (attention_bias)
    levanter = 2 * vocab * hidden + layers * (attn + 3 * hidden * inter + 2 * hidden + 2 * hidden) + hidden
    assert num_parameters(config) == levanter
    assert choose_architecture(config) == "Olmo2ForCausalLM"
    with pytest.raises(ConfigError, match="use_bias also gives its RMSNorms a bias"):
        levanter_args(tmp_path, LEVANTER_OLMO2.replace("{attention_bias}", "false").replace("use_bias: false",
                                                                                              "use_bias: true"))
    llama = LEVANTER_OLMO2.replace("type: olmo2", "type: llama").replace("{attention_bias}", "false")
    with pytest.raises(ConfigError, match="an Olmo2Config field"):
        levanter_args(tmp_path, llama)


def test_levanter_llama_without_norm_weights_is_rmsnorm_without_a_gain(tmp_path: Path) -> None:
    """config/olmo/olmo_7b_repro.yaml (Levanter 9263f81e) trains a llama with use_layer_norm_weight: false: Levanter's
    RmsNorm without its weight (LlamaConfig.norm_config, llama.py:177-182), x / rms(x), not a LayerNorm (which
    subtracts the mean first)."""
    from test_dialects import levanter_args

    text = LEVANTER_OLMO2.replace("type: olmo2", "type: llama").replace("  attention_bias: {attention_bias}\n", "")
    args = levanter_args(tmp_path, text.replace("use_layer_norm_weight: true", "use_layer_norm_weight: false")).args
    assert args.norm == "non_parametric_rmsnorm"
    from megatron.model.norm_layers import NonParametricRMSNorm

    x = torch.randn(3, 8) + 2.0  # a mean far from zero: a LayerNorm would differ
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(NonParametricRMSNorm(8, 1e-6)(x), want)
    with pytest.raises(ConfigError, match="(?i)olmo ?2 without norm weights"):
        levanter_args(tmp_path, LEVANTER_OLMO2.replace("{attention_bias}", "false").replace(
            "use_layer_norm_weight: true", "use_layer_norm_weight: false"))
