"""Levanter's lora_lm.py / sft.py / train_lm's use_hf_model_config take the model from the HF checkpoint's
config.json, not from model: (stanford-crfm/levanter at 9263f81e: lora_lm.py:56,62 ``converter.default_config``,
sft.py:114-123, train_lm.py:93-96; ``LlamaConfig.from_hf_config``, models/llama.py:105-120, reads the fields
compared below), and initialize_from_hf refuses a config whose maths differ from config.json's. The reference is
transformers' own ``LlamaConfig`` object, written with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import load_config


def _hf_llama(tmp_path: Path, **fields: object):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=2, max_position_embeddings=96, vocab_size=8, rms_norm_eps=1e-6,
                     initializer_range=0.01, rope_theta=50000.0, **fields)
    hf.save_pretrained(tmp_path / "hf")
    words = ["<unk>", "<s>", "</s>", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "train.jsonl").write_text('{"text": "a b"}\n')
    return hf


def _lora_yaml(tmp_path: Path, extra: str = "") -> Path:
    """config/lora_llama2.yaml's keys (no model: section), its data and initialize_from_hf made local."""
    path = tmp_path / "lora.yaml"
    path.write_text(f"""data:
  tokenizer: "{tmp_path / 'hf'}"
  train_urls: ["{tmp_path / 'train.jsonl'}"]
  cache_dir: "{tmp_path / 'cache'}"
initialize_from_hf: "{tmp_path / 'hf'}"
peft_save_path: "{tmp_path / 'peft'}"
max_train_length: 32
trainer:
  fsdp_axis: null
  num_train_steps: 10
  train_batch_size: -1
  per_device_parallelism: 4
optimizer:
  learning_rate: 3e-4
{extra}""")
    return path


def _load(path: Path):  # type: ignore[no-untyped-def]
    return load_config([], (), None, split_argv(["--config_path", str(path)])[1])


def test_lora_without_a_model_section_builds_the_hf_configs_model(tmp_path: Path) -> None:
    hf = _hf_llama(tmp_path)
    resolved = _load(_lora_yaml(tmp_path))
    args = resolved.args
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))
    assert (args.hidden_size, args.num_layers, args.num_attention_heads, args.num_kv_heads) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert args.intermediate_size == 3 * hf.intermediate_size  # GPT-NeoX's gated width: 3 x each half's
    assert (args.rms_norm_epsilon, args.rotary_emb_base, args.init_method_std) == (hf.rms_norm_eps, theta,
                                                                                   hf.initializer_range)
    assert (args.norm, args.activation, args.no_weight_tying) == ("rmsnorm", "swiglu", not hf.tie_word_embeddings)
    assert hf.hidden_act == "silu"
    # Pos resized to max_train_length (lora_lm.py:74-77); positions as config.json has them
    assert (args.seq_length, args.max_position_embeddings) == (32, hf.max_position_embeddings)
    assert "hf/config.json (lora_lm.py:56,62@9263f81e)" in resolved.provenance["rms_norm_epsilon"]
    # a tied HF model: no lm_head adapter (lora.py target_modules null; llama.py:500-501)
    _hf_llama(tmp_path, tie_word_embeddings=True)
    assert _load(_lora_yaml(tmp_path)).args.no_weight_tying is False


def test_model_section_is_checked_against_config_json_not_used(tmp_path: Path) -> None:
    _hf_llama(tmp_path)
    agrees = _load(_lora_yaml(tmp_path, "model:\n  hidden_dim: 48\n  num_kv_heads: 2\n"))
    assert agrees.args.hidden_size == 48
    with pytest.raises(ConfigError, match=r"model.layer_norm_epsilon.*hf/config.json.*rms_norm_epsilon 1e-05 where the "
                                          r"model built has 1e-06"):
        _load(_lora_yaml(tmp_path, "model:\n  layer_norm_epsilon: 1e-5\n"))


def test_train_lm_use_hf_model_config_takes_the_whole_model(tmp_path: Path) -> None:
    hf = _hf_llama(tmp_path)
    text = _lora_yaml(tmp_path).read_text()
    for lora_only in ("max_train_length: 32\n", f"peft_save_path: \"{tmp_path / 'peft'}\"\n"):
        text = text.replace(lora_only, "")
    path = tmp_path / "train_lm.yaml"
    path.write_text(text + "use_hf_model_config: true\n")
    args = _load(path).args  # config.model = converter.config_from_hf_config(...): seq_len is config.json's
    assert (args.hidden_size, args.seq_length, args.rms_norm_epsilon) == (hf.hidden_size, 96, 1e-6)


def test_initialize_from_hf_refuses_other_maths_by_name(tmp_path: Path) -> None:
    """train_lm without use_hf_model_config builds model: (Levanter's rms eps default 1e-5, llama.py:66); the HF
    model's 1e-6, rope theta and tying would be silently replaced: refused, each key named."""
    from megatron.config_rules import Device
    from megatron.neox_arguments.derived import finalize

    _hf_llama(tmp_path, tie_word_embeddings=True)
    text = _lora_yaml(tmp_path).read_text().replace("max_train_length: 32\n", "")
    text = text.replace(f"peft_save_path: \"{tmp_path / 'peft'}\"\n", "")
    path = tmp_path / "train_lm.yaml"
    path.write_text(text + "model:\n  hidden_dim: 48\n  intermediate_dim: 80\n  num_layers: 3\n  num_heads: 6\n"
                           "  num_kv_heads: 2\n  seq_len: 96\n")
    resolved = _load(path)
    with pytest.raises(ConfigError) as err:
        finalize(resolved, 1, device=Device(cuda=False, fp16_supported=False))
    message = str(err.value)
    for key, value in (("rms_norm_epsilon", "1e-06"), ("rotary_emb_base", "50000"), ("no_weight_tying", "False")):
        assert f"config.json gives {key} {value}" in message, message
    assert "hidden_size" not in message  # the keys that agree are not named


@pytest.mark.parametrize("hf_scaling", [None, {"rope_type": "linear", "factor": 2.0}], ids=["extension", "other"])
def test_a_rope_scaling_on_a_model_without_one_is_a_context_extension(tmp_path: Path, hf_scaling: object) -> None:
    """Scaling positions of an HF model trained without scaling is a deliberate context extension (the weights are
    the same): accepted with a warning. A config.json with its own scaling must be matched."""
    from megatron.config_rules import RuleContext
    from megatron.interop.hf_keys import neox_model_keys, read_config_json
    from megatron.interop.hf_start import initialize_from_hf_agrees_with_its_config
    from megatron.neox_arguments import NeoXArgs

    _hf_llama(tmp_path, **({"rope_scaling": hf_scaling} if hf_scaling else {}))
    model = neox_model_keys(read_config_json(str(tmp_path / "hf")))
    ours = {"rope_type": "dynamic", "factor": 4.0}
    args = NeoXArgs(**{k: v for k, v in model.items() if k in NeoXArgs.model_fields and k != "rope_scaling"},
                    initialize_from_hf=str(tmp_path / "hf"), rope_scaling=ours)
    ctx = RuleContext(args)
    problems = initialize_from_hf_agrees_with_its_config(ctx)
    if hf_scaling is None:
        assert problems == [] and any("context extension" in w for w in ctx.warnings)
        assert initialize_from_hf_agrees_with_its_config(RuleContext(args.model_copy(update={"rms_norm_epsilon": 1e-5})))
    else:
        assert len(problems) == 1 and "rope_scaling" in problems[0], problems
