"""Mixtral (``MixtralForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``), transformers 5.23.0, in and out of
Deepy's dropless MoE layer (``megatron/interop/hf_moe.py``): softmax top-k routing with the k weights renormalised
(Mixtral always, Qwen3-MoE with ``norm_topk_prob``), stacked SwiGLU experts, Qwen3's per-head query/key RMSNorm.

References are transformers' own models, built here from a ``MixtralConfig`` / ``Qwen3MoeConfig`` (random weights,
norm gains moved off their ones so a dropped or misplaced one shows; nothing downloaded): their logits, parameter
counts and greedy ``generate``. The logit comparisons run both models in the test, not through the converter's
built-in check. The presets' parameter counts are re-derived from transformers' model built on the meta device
with the published sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hf_class_checks import (CONFIG_KEYS, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_each_change_is_named, assert_generation_equals_transformers,
                             assert_preset_counts_as_published, assert_round_trip_at_tp2_pp2, hf_start_args,
                             imported_model, perturbed_model, save_with_tokenizer)
from megatron.errors import ConversionError
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.model import GPTConfig, GPTModel, num_parameters

SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=0,
                             eos_token_id=0)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    # family: (config class, class-specific fields, the HF class)
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, rms_norm_eps=1e-5),
                "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=32,
                                         norm_topk_prob=True, rms_norm_eps=1e-6), "Qwen3MoeForCausalLM"),
}  # fmt: skip
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # one fixture each: untied plain, and tied with the family's other setting (Mixtral's window, Qwen3-MoE's
    # un-normalised top-k, its default)
    "mixtral-untied": ("mixtral", dict(tie_word_embeddings=False)),
    "mixtral-tied-window": ("mixtral", dict(tie_word_embeddings=True, sliding_window=8)),
    "qwen3_moe-untied": ("qwen3_moe", dict(tie_word_embeddings=False)),
    "qwen3_moe-tied-unnormalised": ("qwen3_moe", dict(tie_word_embeddings=True, norm_topk_prob=False)),
}


def hf_config(family: str, **changes: Any) -> Any:
    import transformers

    name, fields, _ = FAMILIES[family]
    return getattr(transformers, name)(**{**SHAPE, **fields, **changes})


def moe_model(family: str, **changes: Any) -> Any:
    return perturbed_model(hf_config(family, **changes), seed=7)  # norms start as ones; no biases


@pytest.fixture(scope="module", params=list(VARIANTS))
def imported(request: pytest.FixtureRequest) -> tuple[str, Any, GPTConfig, GPTModel]:
    family, changes = VARIANTS[request.param]
    theirs = moe_model(family, **changes)
    return (family, theirs, *imported_model(theirs))


def test_moe_model_imports_with_its_router_and_logits(imported: tuple[str, Any, GPTConfig, GPTModel]) -> None:
    family, theirs, config, ours = imported
    assert choose_architecture(config) == FAMILIES[family][2]
    assert (config.moe_num_experts, config.moe_top_k, config.moe_router_type) == (4, 2, "topk")
    assert config.moe_router_renormalize == (family == "mixtral" or theirs.config.norm_topk_prob)
    assert config.num_moe_layers == 2 and config.expert_ffn_hidden_size == 32
    assert config.use_qk_layernorm == (family == "qwen3_moe")
    # Qwen3-MoE's heads are head_dim 32 wide, twice hidden_size / heads (kv_channels)
    assert config.kv_channels == (32 if family == "qwen3_moe" else None)
    window = theirs.config.sliding_window if family == "mixtral" else None
    assert config.sliding_window_width == (None if window is None else window - 1)
    # parameter count: the registry's (every expert and the router), the module's, transformers'
    assert_counts_and_logits_equal(theirs, config, ours)


# one generation per family (3-5 s each): the windowed Mixtral and the renormalised Qwen3-MoE
@pytest.mark.parametrize("imported", ["mixtral-tied-window", "qwen3_moe-untied"], indirect=True)
def test_moe_model_greedy_generation_equals_transformers(imported: tuple[str, Any, GPTConfig, GPTModel]) -> None:
    assert_generation_equals_transformers(imported[1:])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_round_trip_at_tp2_pp2_then_a_trained_step_exports(family: str, tmp_path: Path) -> None:
    source = save_with_tokenizer(moe_model(family, tie_word_embeddings=False), tmp_path / family)
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path, FAMILIES[family][2],
                                        (*CONFIG_KEYS, "hidden_act", "sliding_window", "num_local_experts",
                                         "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "attention_bias",
                                         "use_sliding_window"))  # fmt: skip
    written = yaml.safe_load(trip.written)
    assert (written["moe_num_experts"], written["moe_top_k"], written["intermediate_size"]) == (4, 2, 32)
    # Qwen3-MoE's intermediate_size is the dense MLP's width, which no layer builds when every layer is sparse:
    # not carried, the export writes an expert's
    dense = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
    assert trip.config_b["intermediate_size"] == trip.config_a[dense] == 32
    # MixtralConfig leaves head_dim None (hidden_size // heads, modeling_mixtral.py:278); the export names it
    assert (trip.config_a.get("head_dim") or 16) == trip.config_b["head_dim"] == (16 if family == "mixtral" else 32)

    # one training step on the imported weights (the router and every expert that saw a token move), exported again
    assert_a_trained_step_exports(trip.deepy, tmp_path, moved=["layers.1.mlp.router.weight", "layers.1.mlp.experts.w1",
                                                               "layers.1.mlp.experts.w2"])


def test_moe_what_the_classes_cannot_carry_is_refused_by_name() -> None:
    with pytest.raises(ConversionError, match="decoder_sparse_step: 2"):
        gpt_config_from_hf(hf_config("qwen3_moe", decoder_sparse_step=2))
    with pytest.raises(ConversionError, match=r"mlp_only_layers: \[1\]"):
        gpt_config_from_hf(hf_config("qwen3_moe", mlp_only_layers=[1]))
    with pytest.raises(ConversionError, match="use_sliding_window"):
        gpt_config_from_hf(hf_config("qwen3_moe", use_sliding_window=True, sliding_window=8))
    base: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                padded_vocab_size=128, pos_emb="rotary", norm="rmsnorm", activation="swiglu",
                                use_bias_in_attn_linear=False, use_bias_in_mlp=False, intermediate_size=32,
                                moe_num_experts=4, moe_top_k=2, moe_router_type="topk", moe_router_renormalize=True)
    assert choose_architecture(GPTConfig(**base)) == "MixtralForCausalLM"
    assert choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=True))) == "Qwen3MoeForCausalLM"
    assert choose_architecture(GPTConfig(**dict(base, use_qk_layernorm=True,
                                                moe_router_renormalize=False))) == "Qwen3MoeForCausalLM"
    refused: dict[str, dict[str, Any]] = {
        "moe_router_renormalize: false": dict(moe_router_renormalize=False),
        "moe_router_type: sinkhorn": dict(moe_router_type="sinkhorn", moe_router_renormalize=False),
        "moe_expert_interval: 2": dict(moe_expert_interval=2),
        "use_bias_in_mlp: true": dict(use_bias_in_mlp=True),
        "use_bias_in_attn_linear: true": dict(use_bias_in_attn_linear=True),
        "moe_num_experts: 4 .GPTNeoXForCausalLM": dict(norm="layernorm", activation="gelu"),
        "qk_norm_scope: projection": dict(use_qk_layernorm=True, qk_norm_scope="projection"),
    }
    for match, change in refused.items():
        with pytest.raises(ConversionError, match=match):
            choose_architecture(GPTConfig(**dict(base, **change)))


def test_initialize_from_hf_of_a_mixtral_directory_checks_its_router(tmp_path: Path) -> None:
    """The check before launch reads a Mixtral config.json (plain JSON) and names the MoE key a config would build
    differently (the weights would load into another router)."""
    model, args = hf_start_args(hf_config("mixtral"), tmp_path / "hf")
    assert (model["moe_num_experts"], model["moe_top_k"], model["moe_router_renormalize"]) == (4, 2, True)
    assert_each_change_is_named(args, [("moe_top_k", 1), ("moe_router_renormalize", False)])


# published sizes (each model's config.json on the Hub); the count is transformers' own, of the model built from
# those sizes on the meta device
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral/mixtral-8x7B.yml": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                 num_local_experts=8, num_experts_per_tok=2)),
    "mixtral/mixtral-8x22B.yml": ("mixtral", dict(vocab_size=32000, hidden_size=6144, intermediate_size=16384,
                                                  num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                                                  num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe/qwen3-30B-A3B.yml": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                      moe_intermediate_size=768, num_hidden_layers=48,
                                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "qwen3_moe/qwen3-235B-A22B.yml": ("qwen3_moe", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                                        moe_intermediate_size=1536, num_hidden_layers=94,
                                                        num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_moe_presets_have_the_published_parameter_count(preset: str) -> None:
    import transformers

    family, sizes = PUBLISHED[preset]
    published = getattr(transformers, FAMILIES[family][0])(**sizes)
    ours, theirs = assert_preset_counts_as_published(preset, published)
    assert choose_architecture(ours) == theirs
    # the active parameters (the top-k experts a token visits, and every router): "A3B", "A22B"
    active = num_parameters(ours, active=True) if "qwen3" in preset else None
    assert active is None or round(active / 1e9) == int(preset.split("-A")[1].removesuffix("B.yml"))
