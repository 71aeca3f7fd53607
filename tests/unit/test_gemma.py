"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``), transformers 5.23.0, in and out of
Deepy (``megatron/interop/hf_gemma.py``), and the model keys they need.

References are transformers' own models, built here from a ``Gemma2Config`` / ``Gemma3TextConfig`` (random
weights, norm gains moved off their zeros so a dropped or misplaced norm shows; nothing downloaded): their logits,
parameter counts and greedy ``generate``. The shapes make every Gemma piece count: four layers with a sliding
window (6) shorter than the sequences, Gemma 2's alternating and Gemma 3's 3:1 local/global pattern, a head dim
(24) that is not hidden / heads (16), grouped-query attention, a query_pre_attn_scalar (20) that is not the head
dim, Gemma 2's soft caps, Gemma 3's query/key norms and local rotary base. Published sizes: the presets under
configs/gemma2 and configs/gemma3 against transformers' parameter count of the published configs (meta device).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hf_class_checks import (CONFIG_KEYS, Imported, assert_a_trained_step_exports, assert_counts_and_logits_equal,
                             assert_each_change_is_named, assert_generation_equals_transformers,
                             assert_preset_counts_as_published, assert_round_trip_at_tp2_pp2, hf_start_args,
                             imported_model, max_logit_diff, perturbed_model, save_with_tokenizer, start_problems)
from megatron.errors import ConfigError, ConversionError
from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.interop.hf_model import fixed_batch
from megatron.model import GPTConfig

SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                             rms_norm_eps=1e-6, sliding_window=6, query_pre_attn_scalar=20, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0)  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": dict(attn_logit_softcapping=0.25, final_logit_softcapping=1.0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma3": dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], final_logit_softcapping=0.8,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}  # fmt: skip


def hf_config(family: str, **changes: Any) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig

    cls = Gemma2Config if family == "gemma2" else Gemma3TextConfig
    return cls(**{**SHAPE, **FAMILIES[family], **changes})


def gemma_model(family: str, **changes: Any) -> Any:
    # Gemma's norm gains start at zeros (a gain of 1); no biases
    return perturbed_model(hf_config(family, **changes), seed=7, scale=0.3)


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request: pytest.FixtureRequest) -> Imported:
    theirs = gemma_model(request.param)
    return (theirs, *imported_model(theirs))


def test_gemma_imports_with_its_logits_and_parameter_count(imported: Imported) -> None:
    theirs, config, ours = imported
    gemma3 = theirs.config.model_type == "gemma3_text"
    assert choose_architecture(config) == ("Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM")
    assert (config.norm, config.norm_placement, config.activation) == ("gemma_rmsnorm", "sandwich", "geglu_tanh")
    assert config.kv_channels == 24 and config.query_pre_attn_scalar == 20 and config.scale_embeddings_by_sqrt_hidden
    assert config.sliding_window_width == 5  # HF's window of 6: keys at distance < 6
    if gemma3:
        assert config.attention_config == [[["local", "local", "local", "global"], 1]]
        assert config.use_qk_layernorm and config.rope_local_base_freq == 10000 and config.rotary_emb_base == 1000000
        assert config.attn_logit_softcapping is None and config.final_logit_softcapping == 0.8
    else:
        assert config.attention_config == [[["local", "global"], 2]]
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (0.25, 1.0)
    # the registry's count (sandwich: four norms a layer; Gemma 3: the two head-dim norms), the module's, theirs
    assert_counts_and_logits_equal(theirs, config, ours)


# each Gemma key, undone in our config alone, moves the logits away from transformers'
UNDONE: dict[str, dict[str, Any]] = {
    "attn_logit_softcapping": dict(attn_logit_softcapping=None),
    "final_logit_softcapping": dict(final_logit_softcapping=None),
    "query_pre_attn_scalar": dict(query_pre_attn_scalar=None),
    "scale_embeddings_by_sqrt_hidden": dict(scale_embeddings_by_sqrt_hidden=False),
    "rope_local_base_freq": dict(rope_local_base_freq=None),
    "sliding_window_width": dict(attention_config=None, sliding_window_width=None),
}


def test_each_gemma_key_is_needed_for_equal_logits(imported: Imported) -> None:
    """Each key the family sets (Gemma 3 has no attention cap: its q/k norms stand there), undone alone."""
    theirs, config, ours = imported
    keys = [key for key in UNDONE if getattr(config, key, True) is not None
            and not (key == "attn_logit_softcapping" and config.use_qk_layernorm)]
    assert len(keys) >= 5, keys
    tokens = fixed_batch(config.vocab, 24)
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
    for key in keys:
        assert max_logit_diff(config.replace(**UNDONE[key]), ours.state_dict(), tokens, want) > 1e-3, key


def test_geglu_tanh_is_gemmas_gated_mlp_activation() -> None:
    """activation geglu_tanh: transformers' gelu_pytorch_tanh of the gate half times the up half (Gemma's MLP)."""
    from transformers.activations import ACT2FN

    from megatron.model.activations import get_activation

    x = 3 * torch.randn(5, 16, dtype=torch.float64)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(get_activation("geglu_tanh")(x), ACT2FN["gelu_pytorch_tanh"](gate) * up, atol=1e-12)
    assert not torch.allclose(get_activation("geglu")(x), ACT2FN["gelu_pytorch_tanh"](gate) * up, atol=1e-6)


def test_embedding_scale_is_rounded_to_the_tables_dtype() -> None:
    """scale_embeddings_by_sqrt_hidden in bf16: sqrt(3072) = 55.43 rounds to 55.5 before the product, as HF's
    Gemma2TextScaledWordEmbedding does (embed_scale.to(weight.dtype), modeling_gemma2.py:340-341)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from megatron.model.embedding import GPTEmbedding

    config = GPTConfig(num_layers=1, hidden_size=3072, num_attention_heads=12, seq_length=8, padded_vocab_size=16,
                       pos_emb="rotary", precision="bfloat16", scale_embeddings_by_sqrt_hidden=True)
    ours = GPTEmbedding(config).eval()
    theirs = Gemma2TextScaledWordEmbedding(16, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(ours.word_embeddings.weight)
    tokens = torch.tensor([[1, 2, 3, 15]])
    with torch.no_grad():
        got, want = ours(tokens).transpose(0, 1), theirs(tokens)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(ours.word_embeddings.weight[tokens] * 3072**0.5, want)  # the unrounded factor differs


def test_gemma_norm_is_one_plus_its_weight() -> None:
    """gemma_rmsnorm (zeros at init) computes rmsnorm with the gain 1 + w, the fp32 product cast back once."""
    from megatron.model.norm_layers import GemmaRMSNorm, RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    gemma, plain = GemmaRMSNorm(8, 1e-6), RMSNorm(8, 1e-6)
    assert torch.equal(gemma.weight, torch.zeros(8))
    with torch.no_grad():
        gemma.weight.normal_()
        plain.weight.copy_(1.0 + gemma.weight)
    assert torch.equal(gemma(x), plain(x))


def test_gemma_greedy_generation_equals_transformers(imported: Imported) -> None:
    assert_generation_equals_transformers(imported)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gemma_round_trip_at_tp2_pp2_then_a_trained_step_exports(family: str, tmp_path: Path) -> None:
    source = save_with_tokenizer(gemma_model(family), tmp_path / family)
    trip = assert_round_trip_at_tp2_pp2(source, tmp_path,
                                        "Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM",
                                        (*CONFIG_KEYS, "intermediate_size", "head_dim", "hidden_activation",
                                         "sliding_window", "layer_types", "query_pre_attn_scalar",
                                         "attn_logit_softcapping", "final_logit_softcapping"))  # fmt: skip
    written = yaml.safe_load(trip.written)
    assert written["norm"] == "gemma_rmsnorm" and written["norm_placement"] == "sandwich"
    # one training step on the imported weights (the sandwich norms move too), exported again
    assert_a_trained_step_exports(trip.deepy, tmp_path, moved=["layers.1.mlp_output_norm.weight"])


def test_gemma_what_it_cannot_carry_is_refused_by_name() -> None:
    with pytest.raises(ConversionError, match="use_bidirectional_attention"):
        gpt_config_from_hf(hf_config("gemma3", use_bidirectional_attention=True))
    with pytest.raises(ConversionError, match="rope_type 'linear'"):
        gpt_config_from_hf(hf_config("gemma2", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 2.0}))
    config = gpt_config_from_hf(hf_config("gemma2"), seq_length=32)
    with pytest.raises(ConversionError, match="norm_placement: post"):
        choose_architecture(config.replace(norm_placement="post"))
    # pre-norm is Gemma (1), which has no caps: named, not exported as Gemma 2 without them
    with pytest.raises(ConversionError, match="attn_logit_softcapping: 0.25 .GemmaForCausalLM has none"):
        choose_architecture(config.replace(norm_placement="pre"))
    with pytest.raises(ConversionError, match="scale_embeddings_by_sqrt_hidden: false"):
        choose_architecture(config.replace(scale_embeddings_by_sqrt_hidden=False))
    with pytest.raises(ConversionError, match="rope_local_base_freq without use_qk_layernorm"):
        choose_architecture(config.replace(rope_local_base_freq=100))
    with pytest.raises(ConversionError, match="attn_logit_softcapping with use_qk_layernorm"):
        choose_architecture(config.replace(use_qk_layernorm=True))


def test_capped_scores_are_estimated_as_kept_probabilities() -> None:
    """attn_logit_softcapping computes the scores outside SDPA's fused kernels: the memory estimate counts the
    [b, n, s, s] probabilities its backward keeps, as for SDPA's math kernel."""
    from megatron.engine.memory import sdpa_kernel

    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=64)
    assert sdpa_kernel(config, "bfloat16", 32) == "flash"
    assert sdpa_kernel(config.replace(attn_logit_softcapping=50.0), "bfloat16", 32) == "math"


def test_gemma_keys_are_checked_before_launch() -> None:
    from megatron.config_rules import RuleContext
    from megatron.model.gemma_checks import local_rope_base_has_local_layers, query_scale_has_one_source
    from megatron.neox_arguments import NeoXArgs

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, pos_emb="rotary")
    muP = NeoXArgs(**base, query_pre_attn_scalar=16.0, use_mup=True)
    assert "query_pre_attn_scalar" in query_scale_has_one_source(RuleContext(muP))[0]
    no_local = NeoXArgs(**base, rope_local_base_freq=100)
    assert "has no local layer" in local_rope_base_has_local_layers(RuleContext(no_local))[0]
    local = no_local.model_copy(update={"attention_config": [[["local", "global"], 1]], "sliding_window_width": 4})
    assert local_rope_base_has_local_layers(RuleContext(local)) == []


def test_initialize_from_hf_of_a_gemma_directory_checks_its_keys(tmp_path: Path) -> None:
    """The check before launch reads a Gemma 2 config.json (plain JSON) and names a Gemma key the config lacks."""
    _, args = hf_start_args(hf_config("gemma2"), tmp_path / "hf")
    assert_each_change_is_named(args, [("final_logit_softcapping", None)])
    # the layers' pattern however it is spelled (flash is global attention), but not another pattern
    assert start_problems(args, attention_config=[[["local"], 1], [["flash"], 1], [["local", "global"], 1]]) == []
    assert_each_change_is_named(args, [("attention_config", [[["global"], 4]])])


# published sizes (the models' config.json on the Hub, as transformers 5.23.0 reads them); the parameter count is
# transformers' own, of the model built from the config on the meta device
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2/gemma2-2B.yml": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                            num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                            head_dim=256)),
    "gemma2/gemma2-9B.yml": ("gemma2", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                            num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                            head_dim=256)),
    "gemma3/gemma3-270M.yml": ("gemma3", dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                              num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=256)),
    "gemma3/gemma3-1B.yml": ("gemma3", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                            num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=256)),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_parameter_count(preset: str) -> None:
    from transformers import Gemma2Config, Gemma3TextConfig

    family, sizes = PUBLISHED[preset]
    cls = Gemma2Config if family == "gemma2" else Gemma3TextConfig
    assert_preset_counts_as_published(preset, cls(**sizes), padded_vocab_size=sizes["vocab_size"])


# --- Gemma (1): GemmaForCausalLM, and Levanter's model.type gemma, which is that architecture ---------------------
GEMMA1: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=64,
                              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
LEVANTER_GEMMA = """\
model:
  type: gemma
  hidden_dim: 64
  intermediate_dim: 96
  num_heads: 4
  num_kv_heads: 1
  head_dim: 24
  num_layers: 2
  seq_len: 32
  layer_norm_epsilon: 1.0e-6
trainer:
  mp: p=f32,c=bfloat16
"""


def test_gemma1_both_ways_and_levanters_gemma_is_that_model(tmp_path: Path) -> None:
    """GemmaForCausalLM (transformers 5.23.0 models/gemma/): Gemma 2's pieces less the sandwich, caps, window and
    query scalar. Levanter's GemmaConfig (gemma.py:61-122@9263f81e) builds the same model: its keys, with the sizes
    given, equal the import's on every key that changes the maths."""
    from transformers import GemmaConfig

    from megatron.interop.hf_keys import MATH_KEYS
    from megatron.neox_arguments.dialects.levanter_model import NOT_BUILT
    from test_levanter_keys import load

    theirs = perturbed_model(GemmaConfig(**GEMMA1), seed=3, scale=0.3)
    source = save_with_tokenizer(theirs, tmp_path / "gemma")
    imported = import_to_deepy(source, tmp_path / "deepy")
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-4
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back")
    assert exported.architecture == "GemmaForCausalLM" and exported.max_logit_diff is not None
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)

    config = gpt_config_from_hf(theirs.config, seq_length=32)
    assert (config.norm, config.norm_placement, config.activation) == ("gemma_rmsnorm", "pre", "geglu_tanh")
    assert "gemma" not in NOT_BUILT
    levanter = load(tmp_path, LEVANTER_GEMMA).args
    differ = {k: (getattr(levanter, k), getattr(config, k)) for k in MATH_KEYS if k not in ("attention_config",)
              and getattr(levanter, k) != getattr(config, k)}
    assert differ == {}, differ
    # Levanter's defaults (GemmaConfig: Gemma-2B's shapes, eps 1e-5, tied, gelu_new, one kv head of 256)
    default = load(tmp_path, "model:\n  type: gemma\n").args
    assert (default.hidden_size, default.num_layers, default.num_attention_heads, default.num_kv_heads) == \
        (2048, 18, 8, 1)
    assert (default.intermediate_size, default.rms_norm_epsilon, default.no_weight_tying) == (3 * 16384, 1e-5, False)
    assert default.scale_embeddings_by_sqrt_hidden and default.activation == "geglu_tanh"
    # google/gemma-2b's config.json says hidden_act "gelu": transformers 5.23.0 runs the tanh form
    # (GemmaConfig.__post_init__, configuration_gemma.py:89-96), and so does Levanter (gemma.py:133-150)
    from megatron.interop.hf_keys import neox_model_keys, read_config_json
    from megatron.neox_arguments.dialects.levanter_hf_model import hf_shape

    (tmp_path / "legacy").mkdir()
    legacy = {**json.loads((source / "config.json").read_text()), "hidden_act": "gelu"}
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert neox_model_keys(read_config_json(tmp_path / "legacy"))["activation"] == "geglu_tanh"
    assert hf_shape(str(tmp_path / "legacy")).keys["activation"] == "geglu_tanh"
    (tmp_path / "silu").mkdir()
    (tmp_path / "silu" / "config.json").write_text(json.dumps({**legacy, "hidden_act": "silu"}))
    assert neox_model_keys(read_config_json(tmp_path / "silu"))["activation"] == "swiglu"
    assert hf_shape(str(tmp_path / "silu")).keys["activation"] == "geglu_tanh"  # Levanter: gelu_new whatever it says


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_levanters_gemma2_and_gemma3_are_these_models(family: str, tmp_path: Path) -> None:
    """Levanter's Gemma2Config/Gemma3Config (gemma.py:453-1000@9263f81e) run the sandwich block with the caps their
    attention_config passes and nothing else of HF's: no window, one rotary base, no final-logit cap, scores by
    1/sqrt(head_dim). Their keys equal the import of the transformers model that computes that (all layers full,
    final_logit_softcapping None, query_pre_attn_scalar = head_dim, one rope theta) on every maths key."""
    from megatron.interop.hf_keys import MATH_KEYS
    from test_levanter_keys import load

    text = LEVANTER_GEMMA.replace("type: gemma", f"type: {family}").replace(
        "  seq_len: 32\n", "  seq_len: 32\n  final_logit_softcapping: 30.0\n  query_pre_attn_scalar: 20.0\n"
        "  sliding_window: 6\n")
    if family == "gemma2":
        text = text.replace("  seq_len: 32\n", "  seq_len: 32\n  attn_logit_softcapping: 0.25\n")
    else:
        text = text.replace("  seq_len: 32\n", "  seq_len: 32\n  rope_local_base_freq: 100\n  use_qk_norm: false\n")
    levanter = load(tmp_path, text).args
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    full = dict(GEMMA1, layer_types=["full_attention"] * 2, final_logit_softcapping=None, query_pre_attn_scalar=24,
                attn_logit_softcapping=0.25 if family == "gemma2" else None,
                rope_parameters=rope if family == "gemma2" else {"full_attention": rope, "sliding_attention": rope})
    config = gpt_config_from_hf(hf_config(family, **full), seq_length=32)
    differ = {k: (getattr(levanter, k), getattr(config, k)) for k in MATH_KEYS
              if getattr(levanter, k) != getattr(config, k)}
    assert differ == {}, differ
    assert levanter.use_qk_layernorm is (family == "gemma3")  # Gemma 3's q/k norms whatever use_qk_norm says
    with pytest.raises(ConfigError, match="use_qk_norm"):  # a Gemma2Config field: Gemma (1)'s config has none
        load(tmp_path, LEVANTER_GEMMA.replace("  seq_len: 32\n", "  seq_len: 32\n  use_qk_norm: true\n"))
