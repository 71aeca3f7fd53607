"""rope_scaling: HF's four kinds (linear, dynamic, yarn, llama3) against transformers itself.

The frequencies are compared with transformers' own RoPE functions, the logits of exported models
with transformers' models loaded from the written directory (at a length beyond the original
context, where the kinds differ), and a transformers model with each kind is imported and exported
back unchanged. tests/unit/test_rope_extension.py shows a scaled model extends its context.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hf_conversion import LLAMA, NEOX, hf_logits, our_logits, random_weights

from megatron.errors import ConfigError
from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.hf_config import SpecialTokens, choose_architecture, gpt_config_from_hf, hf_config_from_gpt
from megatron.interop.hf_model import fixed_batch, save_hf_model
from megatron.interop.hf_weights import to_hf_state_dict
from megatron.model import GPTConfig, GPTModel
from megatron.model.kv_cache import KVCache
from megatron.model.rope_scaling import RopeScalingError, parse_rope_scaling

ORIGINAL = 24  # the context the scaled models were "trained" at; the tests run 48 tokens
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_tuned": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIGINAL,
                   "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def _config(base: dict, kind: str) -> GPTConfig:
    # dynamic scales beyond max_position_embeddings (HF's reference for it): keep that at the original
    max_pos = ORIGINAL if kind == "dynamic" else 48
    return GPTConfig(**{**base, "seq_length": 48 if kind != "dynamic" else ORIGINAL, "max_position_embeddings": max_pos,
                        "rope_scaling": SCALINGS[kind]})


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_frequencies_equal_transformers(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.model.positional import RotaryEmbedding

    params = SCALINGS[kind]
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=ORIGINAL,
                            rope_parameters={"rope_theta": 10000.0, **params})
    length = 3 * ORIGINAL  # beyond the original context: dynamic grows its base here
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu", seq_len=length)
    ours = RotaryEmbedding(32, 10000, scaling=parse_rope_scaling(params, ORIGINAL), max_positions=ORIGINAL)
    positions = torch.arange(length).unsqueeze(0)
    angles = positions.float().unsqueeze(-1) * hf_inv_freq
    want_cos = torch.cat([angles, angles], -1).cos() * hf_attention
    cos, _ = ours.cos_sin(positions)
    torch.testing.assert_close(cos[0, 0], want_cos[0], atol=1e-5, rtol=0)  # fp32 angles up to 72 rad


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_exported_scaled_model_computes_our_logits(tmp_path: Path, kind: str) -> None:
    config = _config(LLAMA, kind)
    weights = random_weights(config)
    arch = choose_architecture(config)
    hf_config = hf_config_from_gpt(config, SpecialTokens(0, 0, 1), torch.float32)
    save_hf_model(hf_config, to_hf_state_dict(config, arch, weights), tmp_path, torch.float32)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert written["rope_type"] == SCALINGS[kind]["rope_type"] and written["factor"] == SCALINGS[kind]["factor"]
    tokens = fixed_batch(config.padded_vocab_size, 48)  # twice the original context
    delta = (our_logits(config, weights, tokens) - hf_logits(tmp_path, tokens)).abs().max().item()
    assert delta <= 1e-4, delta
    plain = GPTConfig(**{**LLAMA, "seq_length": 48})  # the check can fail: scaling changes the logits
    assert (our_logits(plain, weights, tokens) - hf_logits(tmp_path, tokens)).abs().max().item() > 1e-3
    assert gpt_config_from_hf(hf_config, config.seq_length).rope_scaling_spec == config.rope_scaling_spec


def test_partial_rotary_neox_with_yarn_matches_transformers(tmp_path: Path) -> None:
    config = _config(NEOX, "yarn")  # yarn's ramp counts the rotated dimensions only
    weights = random_weights(config)
    hf_config = hf_config_from_gpt(config, SpecialTokens(0, 0, 1), torch.float32)
    save_hf_model(hf_config, to_hf_state_dict(config, choose_architecture(config), weights), tmp_path, torch.float32)
    tokens = fixed_batch(config.padded_vocab_size, 48)
    assert (our_logits(config, weights, tokens) - hf_logits(tmp_path, tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_hf_model_with_scaling_imports_and_exports_unchanged(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_theta": 10000.0, **SCALINGS[kind]},
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    source = tmp_path / "hf"
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    export_tokenizer(TokenizerFiles("CharLevelTokenizer"), source, 64)
    imported = import_to_deepy(source, tmp_path / "deepy")  # checks its logits against transformers
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-4
    assert "rope_scaling:" in imported.config_file.read_text()
    exported = export_to_hf(tmp_path / "deepy", tmp_path / "back")
    assert exported.max_logit_diff is not None and exported.max_logit_diff <= 1e-4
    before = json.loads((source / "config.json").read_text())["rope_parameters"]
    after = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert {k: after.get(k) for k in before} == before


def test_decoding_with_a_cache_sees_the_scaled_positions() -> None:
    """Generation runs the same rotary: token-by-token decoding equals the full forward."""
    config = _config(LLAMA, "yarn")
    model = GPTModel(config).eval()
    tokens = fixed_batch(config.padded_vocab_size, 40)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :8], kv_cache=cache)] + [model(tokens[:, i : i + 1], kv_cache=cache)
                                                          for i in range(8, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value, named", [
    ({"rope_type": "longrope", "factor": 2.0}, "not supported"),
    ({"factor": 2.0}, "names no scaling type"),
    ({"rope_type": "linear"}, "needs ['factor']"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "mscale": 1.0}, "mscale"),
    ({"rope_type": "linear", "factor": 0.5}, ">= 1"),
])
def test_bad_scaling_is_refused_by_name(value: dict, named: str) -> None:
    with pytest.raises(RopeScalingError) as err:
        parse_rope_scaling(value, 64)
    assert named in str(err.value)


def test_config_rules_refuse_scaling_before_launch() -> None:
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.derived import finalize
    from megatron.config_rules import Device

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
                train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")
    device = Device(cuda=False, fp16_supported=False)
    ok = finalize(config_from_mapping({**base, "pos_emb": "rotary", "rope_scaling": {"type": "linear", "factor": 2}}),
                  1, device=device)
    assert ok.args.rope_scaling_spec == parse_rope_scaling({"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="rope_scaling.*pos_emb"):
        finalize(config_from_mapping({**base, "rope_scaling": {"type": "linear", "factor": 2}}), 1, device=device)
    with pytest.raises(ConfigError, match="rope_scaling.*'ntk'"):
        finalize(config_from_mapping({**base, "pos_emb": "rotary", "rope_scaling": {"type": "ntk", "factor": 2}}),
                 1, device=device)


@pytest.mark.parametrize(("field", "value", "key"), [("rope_theta", 500000.0, "rotary_emb_base"),
                                                      ("partial_rotary_factor", 0.25, "rotary_pct")])
def test_hf_only_fields_must_say_what_deepys_keys_say(tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str,
                                                      value: float, key: str) -> None:
    """transformers' rope_parameters carry rope_theta and partial_rotary_factor; the model reads rotary_emb_base and
    rotary_pct (issue 30 item 8: a different value was accepted and changed nothing). Refused before launch, by
    name; the same value is accepted (it says nothing new), and so is the dict without the field."""
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    repo = Path(__file__).resolve().parents[2]
    base = ("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\ntrain_iters: 4\nlr: 0.001\n"
            "train_micro_batch_size_per_gpu: 2\nnum_gpus: 1\nuse_dummy_dataset: true\n"
            "tokenizer_type: CharLevelTokenizer\npos_emb: rotary\n")

    def dry_run(scaling: dict) -> tuple[int, str, Path]:
        config = tmp_path / "run.yml"
        config.write_text(base + f"rope_scaling: {json.dumps(scaling)}\n")
        argv = ["--dry-run", str(repo / "train.py"), str(config)]
        with pytest.raises(SystemExit) as done:
            run_guarded(lambda: main(argv), argv=argv)
        out = capsys.readouterr()
        return int(done.value.code or 0), out.out + out.err, config

    linear = {"rope_type": "linear", "factor": 2.0}
    code, out, config = dry_run({**linear, field: value})
    assert code == 2 and "Traceback" not in out, out
    assert f"({config}:12)" in out and f"rope_scaling.{field} {value}" in out and f"set {key}: {value}" in out, out
    same = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0}[field]  # the keys' defaults
    assert dry_run({**linear, field: same})[0] == 0
    # a model built directly (interop, tests) runs the same check
    with pytest.raises(ConfigError, match=f"rope_scaling.{field}"):
        GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, pos_emb="rotary",
                  rope_scaling={**linear, field: value}, padded_vocab_size=128).check_architecture()
