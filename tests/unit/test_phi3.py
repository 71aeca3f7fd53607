"""Phi-3 (``Phi3ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's maths with the query/key/value
projections fused into ``qkv_proj`` and the gate/up projections into ``gate_up_proj``
(``models/phi3/modeling_phi3.py:53-61, 203-222``), split and joined at the converter; a window on every layer
(``sliding_window``, as Mistral's) and a rotated fraction of each head (``partial_rotary_factor``).

References are transformers' own model, built here from a ``Phi3Config`` (random weights, norm gains moved off
their ones; nothing downloaded): its logits, its parameter count and its greedy ``generate``; for the presets,
transformers' model of the published sizes on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megatron.errors import ConversionError
from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.deepy_checkpoint import read_full_checkpoint, write_weights_only_checkpoint
from megatron.interop.hf_config import HFArchitecture, choose_architecture, gpt_config_from_hf
from megatron.interop.hf_model import fixed_batch
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer
from megatron.interop.hf_weights import from_hf_state_dict
from megatron.model import GPTConfig, GPTModel, num_parameters
from test_model_families import assert_greedy_generation_equals_transformers
from test_qwen3 import preset_config

PHI3: HFArchitecture = "Phi3ForCausalLM"
# a window of 9 (HF: keys at distance < 9) over 24-token batches, half of each 16-wide head rotated
SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, sliding_window=9, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})  # fmt: skip


def phi3_model(**changes: Any) -> Any:
    from transformers import AutoModelForCausalLM, Phi3Config

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(Phi3Config(**{**SHAPE, **changes}))
    with torch.no_grad():  # norms start as ones: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def imported() -> tuple[Any, GPTConfig, GPTModel]:
    theirs = phi3_model()
    config = gpt_config_from_hf(theirs.config, seq_length=32)
    ours = GPTModel(config).eval()
    ours.load_state_dict(from_hf_state_dict(config, PHI3, theirs.state_dict()))
    return theirs, config, ours


def test_phi3_imports_with_its_window_partial_rotary_and_logits(imported: tuple[Any, GPTConfig, GPTModel]) -> None:
    theirs, config, ours = imported
    # Llama's maths with a window, but only Phi-3 rotates a fraction of each head: exported as Phi-3 when asked
    assert choose_architecture(config, PHI3) == PHI3
    with pytest.raises(ConversionError, match="rotary_pct: 0.5 .MistralForCausalLM rotates every dimension.*hf_class"):
        choose_architecture(config)
    assert (config.sliding_window_width, config.rotary_pct, config.rotary_dim) == (8, 0.5, 8)
    assert not config.use_bias_in_attn_linear and not config.use_bias_in_mlp
    hf_count = sum(p.numel() for p in theirs.parameters())
    assert num_parameters(config) == sum(p.numel() for p in ours.parameters()) == hf_count
    tokens = fixed_batch(config.vocab, 24)
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        assert (ours(tokens) - want).abs().max().item() <= 1e-4
        # the window and the rotated fraction are read: one key further back, or every dimension rotated, differs
        for change in (dict(sliding_window_width=9), dict(rotary_pct=1.0)):
            other = GPTModel(config.model_copy(update=change)).eval()
            other.load_state_dict(ours.state_dict())
            assert (other(tokens) - want).abs().max().item() > 1e-3, change


def test_phi3_greedy_generation_equals_transformers(imported: tuple[Any, GPTConfig, GPTModel]) -> None:
    theirs, config, ours = imported
    assert_greedy_generation_equals_transformers(ours, theirs, vocab=config.vocab, hidden=config.arch.hidden)


def test_phi3_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    source = tmp_path / "phi3"
    phi3_model().save_pretrained(source)
    export_tokenizer(TokenizerFiles("CharLevelTokenizer"), source, 64)
    imported = import_to_deepy(source, tmp_path / "deepy", tp=2, pp=2)
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-4
    with pytest.raises(ConversionError, match="export with hf_class Phi3ForCausalLM"):
        export_to_hf(tmp_path / "deepy", tmp_path / "as_mistral")
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back", hf_class=PHI3)
    assert exported.architecture == PHI3
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= 1e-4
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in back and "model.layers.0.mlp.gate_up_proj.weight" in back
    assert set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
    config_a = json.loads((source / "config.json").read_text())
    config_b = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "num_hidden_layers", "rope_parameters", "tie_word_embeddings",
                "max_position_embeddings", "hidden_act", "rms_norm_eps", "sliding_window", "resid_pdrop",
                "embd_pdrop"):
        assert config_a.get(key) == config_b.get(key), key

    # one training step on the imported weights, exported again as Phi-3
    full = read_full_checkpoint(tmp_path / "deepy")
    model = GPTModel(full.config)
    model.load_state_dict(full.weights)
    tokens = fixed_batch(full.config.vocab, 17)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_weights_only_checkpoint(tmp_path / "trained", config=full.config, weights=trained, tp=1, pp=1, step=1,
                                  args=full.args)  # fmt: skip
    export_to_hf(tmp_path / "trained", tmp_path / "trained_hf", hf_class=PHI3)
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "trained_hf", dtype=torch.float32,
                                                  local_files_only=True).eval()
    assert type(theirs).__name__ == PHI3
    model.eval()
    with torch.no_grad():
        assert (model(tokens) - theirs(input_ids=tokens).logits).abs().max().item() <= 1e-4


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
    from transformers import AutoModelForCausalLM, Phi3Config

    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(Phi3Config(**PUBLISHED[preset]))
    ours = preset_config(preset)
    assert num_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    assert choose_architecture(ours, PHI3) == PHI3
