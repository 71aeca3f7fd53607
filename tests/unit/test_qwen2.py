"""Qwen2 (``Qwen2ForCausalLM``, transformers 5.23.0) in and out of Deepy: Llama's block with biases on the
query/key/value projections alone (``use_bias_in_qkv``; ``models/qwen2/modeling_qwen2.py:181-184``).

References are transformers' own model, built here from a ``Qwen2Config`` (random weights, norm gains and
biases moved off their ones/zeros so a dropped or misplaced one shows; nothing downloaded): its logits, its
parameter count and its greedy ``generate``. The logit comparisons run both models in the test, not through
the converter's built-in check.
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
from megatron.interop.convert import check_neox_flags, export_to_hf, import_to_deepy
from megatron.interop.deepy_checkpoint import read_full_checkpoint, write_weights_only_checkpoint
from megatron.interop.hf_config import choose_architecture, gpt_config_from_hf
from megatron.interop.hf_model import fixed_batch
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer
from megatron.interop.hf_weights import from_hf_state_dict
from megatron.model import GPTConfig, GPTModel, num_parameters
from test_model_families import assert_greedy_generation_equals_transformers

SHAPE: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=0,
                             eos_token_id=0)  # fmt: skip


def qwen2_model(tied: bool, **changes: Any) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE, tie_word_embeddings=tied, **changes))
    with torch.no_grad():  # norms start as ones, biases as zeros: make them count
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def save(model: Any, out: Path) -> Path:
    model.save_pretrained(out)
    export_tokenizer(TokenizerFiles("CharLevelTokenizer"), out, 64)
    return out


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def imported(request: pytest.FixtureRequest) -> tuple[Any, GPTConfig, GPTModel]:
    theirs = qwen2_model(tied=request.param)
    config = gpt_config_from_hf(theirs.config, seq_length=32)
    ours = GPTModel(config).eval()
    ours.load_state_dict(from_hf_state_dict(config, choose_architecture(config), theirs.state_dict()))
    return theirs, config, ours


def test_qwen2_imports_with_its_biases_and_logits(imported: tuple[Any, GPTConfig, GPTModel]) -> None:
    theirs, config, ours = imported
    assert choose_architecture(config) == "Qwen2ForCausalLM"
    assert config.use_bias_in_qkv and not config.use_bias_in_attn_linear and not config.use_bias_in_mlp
    names = dict(ours.named_parameters())
    assert "layers.0.attention.query_key_value.bias" in names and "layers.0.attention.dense.bias" not in names
    # parameter count: the registry's (use_bias_in_qkv adds the QKV bias rows only), the module's, transformers'
    hf_count = sum(p.numel() for p in theirs.parameters())
    assert num_parameters(config) == sum(p.numel() for p in ours.parameters()) == hf_count
    tokens = fixed_batch(config.vocab, 24)
    with torch.no_grad():
        delta = (ours(tokens) - theirs(input_ids=tokens).logits).abs().max().item()
    assert delta <= 1e-4


def test_qwen2_greedy_generation_equals_transformers(imported: tuple[Any, GPTConfig, GPTModel]) -> None:
    theirs, config, ours = imported
    assert_greedy_generation_equals_transformers(ours, theirs, vocab=config.vocab, hidden=config.arch.hidden)


def test_qwen2_round_trip_at_tp2_pp2_then_a_trained_step_exports(tmp_path: Path) -> None:
    source = save(qwen2_model(tied=False), tmp_path / "qwen2")
    imported = import_to_deepy(source, tmp_path / "deepy", tp=2, pp=2)
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-4
    assert "use_bias_in_qkv: true" in imported.config_file.read_text()
    with pytest.raises(ConversionError, match="holds a Qwen2ForCausalLM model .GPT-NeoX's converter has no flag"):
        check_neox_flags(tmp_path / "deepy", None, None, "llama")
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back")
    assert exported.architecture == "Qwen2ForCausalLM"
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= 1e-4
    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back) and all(torch.equal(original[k], back[k]) for k in original)
    config_a = json.loads((source / "config.json").read_text())
    config_b = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "num_hidden_layers", "rope_parameters", "tie_word_embeddings",
                "max_position_embeddings", "hidden_act", "rms_norm_eps", "use_sliding_window", "layer_types"):
        assert config_a.get(key) == config_b.get(key), key

    # one training step on the imported weights (every weight moves, the QKV biases included), exported again
    full = read_full_checkpoint(tmp_path / "deepy")
    model = GPTModel(full.config)
    model.load_state_dict(full.weights)
    tokens = fixed_batch(full.config.vocab, 17)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    key = "layers.1.attention.query_key_value.bias"
    assert not torch.equal(trained[key], full.weights[key])
    write_weights_only_checkpoint(tmp_path / "trained", config=full.config, weights=trained, tp=1, pp=1, step=1,
                                  args=full.args)  # fmt: skip
    export_to_hf(tmp_path / "trained", tmp_path / "trained_hf")
    model.eval()
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(tmp_path / "trained_hf", tokens)).abs().max().item() <= 1e-4


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

    from megatron.config_rules import RuleContext
    from megatron.interop.hf_keys import neox_model_keys, read_config_json
    from megatron.interop.hf_start import initialize_from_hf_agrees_with_its_config
    from megatron.neox_arguments import NeoXArgs

    Qwen2Config(**SHAPE).save_pretrained(tmp_path / "hf")
    model = neox_model_keys(read_config_json(tmp_path / "hf"))
    biases = (model["use_bias_in_qkv"], model["use_bias_in_attn_linear"], model["use_bias_in_mlp"])
    assert biases == (True, False, False)
    args = NeoXArgs(**{k: v for k, v in model.items() if k in NeoXArgs.model_fields},
                    initialize_from_hf=str(tmp_path / "hf"))
    assert initialize_from_hf_agrees_with_its_config(RuleContext(args)) == []
    llama_block = args.model_copy(update={"use_bias_in_qkv": False})
    problems = initialize_from_hf_agrees_with_its_config(RuleContext(llama_block))
    assert len(problems) == 1 and "use_bias_in_qkv" in problems[0], problems
