"""Phi-3 (``Phi3ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's maths with the query/key/value
projections fused into ``qkv_proj`` and the gate/up projections into ``gate_up_proj``
(``models/phi3/modeling_phi3.py:53-61, 203-222``), split and joined at the converter; a window on every layer
(``sliding_window``, as Mistral's) and a rotated fraction of each head (``partial_rotary_factor``).

References are transformers' own model, built here from a ``Phi3Config`` (random weights, norm gains moved off
their ones; nothing downloaded): its logits, its parameter count and its greedy ``generate``; for the presets,
transformers' model of the published sizes on the meta device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hf_class_checks import (CONFIG_KEYS, Imported, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_generation_equals_transformers, assert_preset_counts_as_published,
                             assert_round_trip_at_tp2_pp2, imported_model, max_logit_diff, perturbed_model,
                             save_with_tokenizer)
from megatron.errors import ConversionError
from megatron.interop.convert import export_to_hf
from megatron.interop.hf_config import HFArchitecture, choose_architecture, gpt_config_from_hf
from megatron.model import GPTConfig

PHI3: HFArchitecture = "Phi3ForCausalLM"
# a window of 9 (HF: keys at distance < 9) over 24-token batches, half of each 16-wide head rotated
SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, sliding_window=9, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})  # fmt: skip


def phi3_model(**changes: Any) -> Any:
    from transformers import Phi3Config

    return perturbed_model(Phi3Config(**{**SHAPE, **changes}), seed=11)  # norms start as ones; no biases


@pytest.fixture(scope="module")
def imported() -> Imported:
    theirs = phi3_model()
    return (theirs, *imported_model(theirs, PHI3))


def test_phi3_imports_with_its_window_partial_rotary_and_logits(imported: Imported) -> None:
    theirs, config, ours = imported
    # Llama's maths with a window, but only Phi-3 rotates a fraction of each head: exported as Phi-3 when asked
    assert choose_architecture(config, PHI3) == PHI3
    with pytest.raises(ConversionError, match="rotary_pct: 0.5 .MistralForCausalLM rotates every dimension.*hf_class"):
        choose_architecture(config)
    assert (config.sliding_window_width, config.rotary_pct, config.rotary_dim) == (8, 0.5, 8)
    assert not config.use_bias_in_attn_linear and not config.use_bias_in_mlp
    tokens, want = assert_counts_and_logits_equal(theirs, config, ours)
    # the window and the rotated fraction are read: one key further back, or every dimension rotated, differs
    for change in (dict(sliding_window_width=9), dict(rotary_pct=1.0)):
        assert max_logit_diff(config.model_copy(update=change), ours.state_dict(), tokens, want) > 1e-3, change


def test_phi3_greedy_generation_equals_transformers(imported: Imported) -> None:
    assert_generation_equals_transformers(imported)


def test_phi3_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    source = save_with_tokenizer(phi3_model(), tmp_path / "phi3")
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path, PHI3,
                                        (*CONFIG_KEYS, "intermediate_size", "hidden_act", "sliding_window",
                                         "resid_pdrop", "embd_pdrop"), hf_class=PHI3)  # fmt: skip
    assert "model.layers.0.self_attn.qkv_proj.weight" in trip.back
    assert "model.layers.0.mlp.gate_up_proj.weight" in trip.back
    with pytest.raises(ConversionError, match="export with hf_class Phi3ForCausalLM"):
        export_to_hf(trip.deepy, tmp_path / "as_mistral")
    # one training step on the imported weights, exported again as Phi-3
    theirs = assert_a_trained_step_exports(trip.deepy, tmp_path, hf_class=PHI3)
    assert type(theirs).__name__ == PHI3


def test_phi3_what_it_cannot_carry_is_refused_by_name() -> None:
    from transformers import Phi3Config

    factors = [1.0] * 4  # rotary_ndims // 2 of an 8-dimension rotation
    longrope = Phi3Config(**{**SHAPE, "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5, "short_factor": factors,
                                                          "long_factor": factors}})
    with pytest.raises(ConversionError, match="rope_type 'longrope'"):
        gpt_config_from_hf(longrope)
    with pytest.raises(ConversionError, match="resid_pdrop: 0.1 .Deepy's hidden_dropout drops the embedding output"):
        gpt_config_from_hf(Phi3Config(**SHAPE, resid_pdrop=0.1))
    base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                padded_vocab_size=128, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                use_bias_in_attn_linear=False, use_bias_in_mlp=False)
    assert choose_architecture(GPTConfig(**base), PHI3) == PHI3
    with pytest.raises(ConversionError, match="Phi3ForCausalLM has no biases"):
        choose_architecture(GPTConfig(**dict(base, use_bias_in_mlp=True)), PHI3)
    with pytest.raises(ConversionError, match="kv_channels: 24 .Phi3Config has no head_dim"):
        choose_architecture(GPTConfig(**dict(base, kv_channels=24)), PHI3)
    with pytest.raises(ConversionError, match="the model exports as Qwen3ForCausalLM"):
        choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=True)), PHI3)
    # Llama's maths, all of each head rotated: Llama by default, Phi-3 when asked
    assert choose_architecture(GPTConfig(**base)) == "LlamaForCausalLM"


# published sizes (each model's config.json on the Hub); Phi-3 small (7B) is Phi3SmallForCausalLM, not Phi-3's class
PUBLISHED: dict[str, dict[str, Any]] = {
    "phi3/phi3-mini.yml": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32),
    "phi3/phi3-medium.yml": dict(vocab_size=32064, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                                 num_attention_heads=40, num_key_value_heads=10),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_phi3_presets_have_the_published_parameter_count(preset: str) -> None:
    from transformers import Phi3Config

    ours, _ = assert_preset_counts_as_published(preset, Phi3Config(**PUBLISHED[preset]))
    assert choose_architecture(ours, PHI3) == PHI3
