"""Qwen2 (``Qwen2ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's block with biases on the
query/key/value projections alone (``use_bias_in_qkv``; ``models/qwen2/modeling_qwen2.py:181-184``).

References are transformers' own model, built here from a ``Qwen2Config`` (random weights, norm gains and
biases moved off their ones/zeros so a dropped or misplaced one shows; nothing downloaded): its logits, its
parameter count and its greedy ``generate``. The logit comparisons run both models in the test, not through
the converter's built-in check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hf_class_checks import (CONFIG_KEYS, Imported, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_each_change_is_named, assert_generation_equals_transformers,
                             assert_round_trip_at_tp2_pp2, hf_start_args, imported_model, perturbed_model,
                             save_with_tokenizer)
from megatron.errors import ConversionError
from megatron.interop.convert import check_neox_flags
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.model import GPTConfig

SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=0,
                             eos_token_id=0)  # fmt: skip


def qwen2_model(tied: bool, **changes: Any) -> Any:
    from transformers import Qwen2Config

    return perturbed_model(Qwen2Config(**SHAPE, tie_word_embeddings=tied, **changes), seed=5)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def imported(request: pytest.FixtureRequest) -> Imported:
    theirs = qwen2_model(tied=request.param)
    return (theirs, *imported_model(theirs))


def test_qwen2_imports_with_its_biases_and_logits(imported: Imported) -> None:
    theirs, config, ours = imported
    assert choose_architecture(config) == "Qwen2ForCausalLM"
    assert config.use_bias_in_qkv and not config.use_bias_in_attn_linear and not config.use_bias_in_mlp
    names = dict(ours.named_parameters())
    assert "layers.0.attention.query_key_value.bias" in names and "layers.0.attention.dense.bias" not in names
    # parameter count: the registry's (use_bias_in_qkv adds the QKV bias rows only), the module's, transformers'
    assert_counts_and_logits_equal(theirs, config, ours)


def test_qwen2_greedy_generation_equals_transformers(imported: Imported) -> None:
    assert_generation_equals_transformers(imported)


def test_qwen2_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    source = save_with_tokenizer(qwen2_model(tied=False), tmp_path / "qwen2")
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path, "Qwen2ForCausalLM",
                                        (*CONFIG_KEYS, "intermediate_size", "hidden_act", "use_sliding_window",
                                         "layer_types"))  # fmt: skip
    assert "use_bias_in_qkv: true" in trip.written
    with pytest.raises(ConversionError, match="holds a Qwen2ForCausalLM model .GPT-NeoX's converter has no flag"):
        check_neox_flags(trip.deepy, None, None, "llama")
    # one training step on the imported weights (every weight moves, the QKV biases included), exported again
    assert_a_trained_step_exports(trip.deepy, tmp_path, moved=["layers.1.attention.query_key_value.bias"])


def test_qwen2_what_it_cannot_carry_is_refused_by_name() -> None:
    from transformers import Qwen2Config

    windowed = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ConversionError, match="use_sliding_window"):
        gpt_config_from_hf(windowed)
    base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                padded_vocab_size=128, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                use_bias_in_attn_linear=False, use_bias_in_qkv=True, use_bias_in_mlp=False)
    assert choose_architecture(GPTConfig(**base)) == "Qwen2ForCausalLM"
    with pytest.raises(ConversionError, match="use_bias_in_mlp: true with use_bias_in_qkv"):
        choose_architecture(GPTConfig(**dict(base, use_bias_in_mlp=True)))
    with pytest.raises(ConversionError, match="use_bias_in_qkv: true with sliding_window_width"):
        choose_architecture(GPTConfig(**dict(base, sliding_window_width=8)))
    # both attention biases: Llama's attention_bias, the QKV switch changes nothing
    assert choose_architecture(GPTConfig(**dict(base, use_bias_in_attn_linear=True))) == "LlamaForCausalLM"


def test_initialize_from_hf_of_a_qwen2_directory_checks_its_biases(tmp_path: Path) -> None:
    """The check before launch reads a Qwen2 config.json (plain JSON) and names use_bias_in_qkv when a config
    would build the model without the Q/K/V biases (Llama's block)."""
    from transformers import Qwen2Config

    model, args = hf_start_args(Qwen2Config(**SHAPE), tmp_path / "hf")
    biases = (model["use_bias_in_qkv"], model["use_bias_in_attn_linear"], model["use_bias_in_mlp"])
    assert biases == (True, False, False)
    assert_each_change_is_named(args, [("use_bias_in_qkv", False)])  # Llama's block
