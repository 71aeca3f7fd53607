"""Levanter's sft.py and lora_lm.py configs (stanford-crfm/levanter at 9263f81e): which tokens an SFT
conversation trains on (against Levanter's own steps re-run with transformers), and each key family of their
configs as Deepy reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.dialects.levanter_sft import convert_argv
from megatron.neox_arguments.loading import load_config
from megatron.tokenizer.hf import HFTokenizer
from tools.datasets import preprocess_data_with_mask as tool

WORDS = ["<s>", "</s>", "[UNK]", "what", "is", "2", "+", "?", "4", "say", "hel", "hello", "lo", "there", "thanks",
         "bye", "you", "are", "welcome"]



TINY_LLAMA = """model:
  type: llama
  seq_len: 64
  hidden_dim: 32
  intermediate_dim: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 4
trainer:
  num_train_steps: 10
  train_batch_size: 4
"""
"""A tiny Llama and a 10-step trainer, in Levanter's keys."""

def _tokenizer_dir(tmp_path: Path, eos_in_template: bool = False) -> Path:
    """A word-level tokenizer whose post-processor adds a BOS (as Llama's does), saved as tokenizer.json with a
    tokenizer_config.json naming its special tokens (what transformers reads)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = "<s> $A </s>" if eos_in_template else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    out = tmp_path / ("tok_eos" if eos_in_template else "tok")
    if out.is_dir():
        return out
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def _levanter_reference(tok_dir: Path, messages: list[dict], max_len: int) -> tuple[list[int], list[int]] | None:
    """Levanter's own steps, re-run with transformers' tokenizer: text.py:1430-1431 (the first user and the first
    assistant message), text.py:812-843 + 857-858 (EOS text appended when "hi there" does not end with it; the
    prompt and prompt+completion tokenized with truncation), sft.py:386-397 (skips, truncation) and
    packing.py:142-143 (loss at positions >= prompt_length - 1, but not the last: targets ids[prompt_length:])."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="</s>", bos_token="<s>",
                                 model_max_length=max_len)
    source = next(m["content"] for m in messages if m["role"] == "user")
    target = next(m["content"] for m in messages if m["role"] == "assistant")
    if hf("hi there")["input_ids"][-1] != hf.eos_token_id:
        target += hf.eos_token
    sources_len = len(hf([source], padding=False, truncation=True)["input_ids"][0])
    ids = hf([source + target], padding=False, truncation=True)["input_ids"][0][:max_len]
    if sources_len > max_len - 1 or len(ids) <= sources_len:
        return None
    mask = np.arange(len(ids)) >= sources_len - 1
    mask[-1] = False
    # position i carries the loss of predicting ids[i + 1]: Deepy's labels name the target token itself
    labels = [-100] + [ids[i + 1] if mask[i] else -100 for i in range(len(ids) - 1)]
    return ids, labels


TWO_TURNS = [{"role": "user", "content": "what is 2 + 2 ?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "you are welcome"}]


@pytest.mark.parametrize("eos_in_template", [False, True])
def test_single_turn_trains_on_levanters_tokens(tmp_path: Path, eos_in_template: bool) -> None:
    tok_dir = _tokenizer_dir(tmp_path, eos_in_template)
    tokenizer = HFTokenizer(str(tok_dir / "tokenizer.json"))
    eos = tool._eos_text(tokenizer, str(tok_dir / "tokenizer.json"))
    turn = tool.SingleTurn("user", "assistant", 64)
    got = tool.encode_single_turn(tokenizer, TWO_TURNS, turn, eos, "t")
    assert got == _levanter_reference(tok_dir, TWO_TURNS, 64)
    ids, labels = got
    # written out: <s> what is 2 + 2 ? 4 </s>, loss on "4" and </s> only; the second exchange is not read
    if not eos_in_template:
        assert [WORDS[i] for i in ids] == ["<s>", "what", "is", "2", "+", "2", "?", "4", "</s>"]
        assert [WORDS[t] for t in labels if t != -100] == ["4", "</s>"]


def test_single_turn_boundary_and_skips_follow_levanter(tmp_path: Path) -> None:
    tok_dir = _tokenizer_dir(tmp_path)
    tokenizer = HFTokenizer(str(tok_dir / "tokenizer.json"))
    eos = tool._eos_text(tokenizer, str(tok_dir / "tokenizer.json"))
    # prompt and completion are joined without a separator: "say hel" + "lo there" is "say hello there",
    # whose "hello" sits inside the prompt's length and gets no loss
    merged = [{"role": "user", "content": "say hel"}, {"role": "assistant", "content": "lo there"}]
    for max_len in (64, 4, 3, 2):
        got = tool.encode_single_turn(tokenizer, merged, tool.SingleTurn(max_length=max_len), eos, "t")
        assert got == _levanter_reference(tok_dir, merged, max_len), max_len
    assert tool.encode_single_turn(tokenizer, merged, tool.SingleTurn(max_length=3), eos, "t") is None
    with pytest.raises(Exception, match="role 'user'"):
        tool.encode_single_turn(tokenizer, [{"role": "assistant", "content": "4"}], tool.SingleTurn(), eos, "t")


# ------------------------------------------------------------------------------------------- configs


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(text)
    return path


def _load(path: Path):
    _, flags = split_argv(["--config_path", str(path)])
    return load_config([], (), None, flags)


def _hf_model(tmp_path: Path, **fields: object) -> Path:
    """TINY_LLAMA's shape as transformers writes it (the model lora_lm.py and sft.py build, from config.json)."""
    from transformers import LlamaConfig

    model = tmp_path / "hf_model"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=64, vocab_size=len(WORDS), **fields).save_pretrained(model)
    return model


def _sft_yaml(tmp_path: Path, tok_dir: Path, extra: str = "") -> str:
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": TWO_TURNS}) + "\n" for _ in range(3)))
    return f"""dataset_type: chat_jsonl
chat_train_urls: ["{chats}"]
supervised_data:
  cache_dir: "{tmp_path / 'cache'}"
max_seq_len: 64
tokenizer: "{tok_dir}"
{TINY_LLAMA}  fsdp_axis: null  # ZeRO stage 0: a start from the HF import's weights-only checkpoint
optimizer:
  learning_rate: 5e-6
  lr_schedule: linear
  warmup: 0.03
  min_lr_ratio: 0.0
initialize_from_hf: true
model_name_or_path: "{_hf_model(tmp_path)}"
messages_field: messages
input_role: user
output_role: assistant
{extra}"""


def test_sft_chats_are_converted_once_before_launch(tmp_path: Path) -> None:
    from megatron.app.prepare import pending, run_steps

    tok_dir = _tokenizer_dir(tmp_path)
    path = _write(tmp_path, _sft_yaml(tmp_path, tok_dir))
    resolved = _load(path)
    (step,) = pending(resolved.dialect)
    assert step["argv"][:2] == ["tools/datasets/preprocess_data_with_mask.py", "--single-turn"]
    with pytest.raises(ConfigError, match="convert first with python tools/datasets/preprocess_data_with_mask.py"):
        run_steps(resolved.dialect, in_place=True)  # every rank would run it: the user converts first
    (done,) = run_steps(resolved.dialect, in_place=False)  # what deepy.py does before it launches
    assert "converted" in done and pending(resolved.dialect) == []
    assert run_steps(resolved.dialect, in_place=False) == []  # once
    resolved = _load(path)
    assert "prepare" not in resolved.dialect
    args = resolved.args
    prefix = args.train_data_paths[0][: -len("_text_document")]
    assert args.train_label_data_paths == [prefix + "_label_document"]
    assert args.pack_impl == "pack_until_overflow"
    assert args.tokenizer_type == "HFTokenizer" and args.vocab_file == str(tok_dir / "tokenizer.json")
    # initialize_from_hf: true reads model_name_or_path (sft.py:114); max_seq_len becomes the length (sft.py:123)
    assert args.initialize_from_hf == str(tmp_path / "hf_model")
    assert args.seq_length == 64
    assert args.lr == 5e-6 and args.levanter_lr_schedule == "linear"
    labels = MMapIndexedDataset(prefix + "_label_document")
    text = MMapIndexedDataset(prefix + "_text_document")
    assert len(text) == 3
    tokenizer = HFTokenizer(str(tok_dir / "tokenizer.json"))
    expected = tool.encode_single_turn(tokenizer, TWO_TURNS, tool.SingleTurn(max_length=64),
                                       tool._eos_text(tokenizer, str(tok_dir / "tokenizer.json")), "t")
    assert (list(text[0]), list(labels[0])) == expected
    # the resolved config feeds Deepy's SFT dataset: whole conversations per sample, loss on the completions only
    from megatron.config_rules import Device
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.run_config import data_run
    from megatron.neox_arguments.derived import finalize

    device = Device(cuda=False, fp16_supported=False)
    resolved = finalize(resolved, 1, device=device)
    sample = build_datasets(data_run(resolved.args), tokenizer, 128).train[0]
    trained = [WORDS[t] for t in sample["label"] if t >= 0]
    assert trained == ["4", "</s>"] * 3  # three 9-token conversations in one 65-token sample
    # Levanter's default fsdp_axis (embed, as these configs write it) is ZeRO-3 here, which starts from the
    # weights-only import too (checkpointing/partitioned_load.py; tests/e2e/test_hf_interop.py runs it)
    path.write_text(path.read_text().replace("  fsdp_axis: null", "  fsdp_axis: embed"))
    zero3 = finalize(_load(path), 1, device=device).args
    assert zero3.zero_optimization["stage"] == 3 and zero3.initialize_from_hf


@pytest.mark.parametrize(("extra", "message"), [
    ("mixture_weights: {tulu: 1}\n", "not a field of Levanter's SFTConfig"),
    ("reinit_tokens: 3\n", "reinit_tokens.*a list of token strings"),
    ("data:\n  cache_dir: x\n", "no data section"),
])
def test_sft_keys_refused_by_name(tmp_path: Path, extra: str, message: str) -> None:
    path = _write(tmp_path, _sft_yaml(tmp_path, _tokenizer_dir(tmp_path), extra))
    with pytest.raises(ConfigError, match=message):
        _load(path)


@pytest.mark.parametrize(("extra", "expected"), [
    # sft.py:88-96,245-274@9263f81e: true names llama3's five chat tokens (sft.py:250-258), a list its tokens, a false
    # value (an empty list too) nothing; reinit_lm_head and reinit_embeddings default to true
    ("reinit_tokens: true\n", (["<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                                "<|eot_id|>"], True, True)),
    ("reinit_tokens: [hello, bye]\nreinit_lm_head: false\n", (["hello", "bye"], False, True)),
    ("reinit_tokens: [hello]\nreinit_embeddings: false\n", (["hello"], True, False)),
    ("reinit_tokens: []\nreinit_lm_head: false\n", (None, True, True)),
    ("reinit_tokens: false\n", (None, True, True)),
])
def test_sft_reinit_tokens_map_onto_deepys_keys(tmp_path: Path, extra: str, expected: tuple[object, ...]) -> None:
    args = _load(_write(tmp_path, _sft_yaml(tmp_path, _tokenizer_dir(tmp_path), extra))).args
    assert (args.reinit_tokens, args.reinit_lm_head, args.reinit_embeddings) == expected


def test_sft_examples_are_shuffled_as_levanters_permutation_dataset(tmp_path: Path) -> None:
    # sft.py:179@9263f81e wraps the examples in PermutationDataset, whatever LMTaskConfig.shuffle's default (False,
    # which train_lm.py's data keeps: test_levanter_dialect.py)
    args = _load(_write(tmp_path, _sft_yaml(tmp_path, _tokenizer_dir(tmp_path)))).args
    assert args.data_shuffle is True


def test_sft_trains_at_max_seq_len_from_hf(tmp_path: Path) -> None:
    # sft.py:72,123@9263f81e: with initialize_from_hf the model's length is max_seq_len (default 2048), not model.seq_len
    text = _sft_yaml(tmp_path, _tokenizer_dir(tmp_path)).replace("max_seq_len: 64\n", "")
    args = _load(_write(tmp_path, text)).args
    assert (args.seq_length, args.max_position_embeddings) == (2048, 2048)


def test_sft_requires_a_start_and_local_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hub"))  # hub names are looked up there
    tok_dir = _tokenizer_dir(tmp_path)
    text = _sft_yaml(tmp_path, tok_dir).replace("initialize_from_hf: true\n", "")
    with pytest.raises(ConfigError, match="Must specify either"):
        _load(_write(tmp_path, text))
    remote = _sft_yaml(tmp_path, tok_dir).replace('model_name_or_path: "', 'model_name_or_path: "gs://b/')
    with pytest.raises(ConfigError, match="is a URL; Deepy reads the directory save_pretrained wrote .*downloads nothing"):
        _load(_write(tmp_path, remote))
    hub = _sft_yaml(tmp_path, tok_dir, "").replace(f'tokenizer: "{tok_dir}"', 'tokenizer: "meta-llama/Llama-3.1-8B"')
    with pytest.raises(ConfigError, match="hub name whose tokenizer.json is not in this machine's hub cache"):
        _load(_write(tmp_path, hub))


def test_convert_command_names_every_setting(tmp_path: Path) -> None:
    from megatron.neox_arguments.dialects.common import Context, Leaf

    ctx = Context({k: Leaf(k, v, "f:1") for k, v in {"messages_field": "conv", "input_role": "human",
                                                     "output_role": "gpt", "max_seq_len": 128}.items()})
    args = tool.parse_args(list(convert_argv(ctx, ["a.jsonl"], "tok.json", "cache/p"))[1:])
    assert (args.messages_key, args.input_role, args.output_role, args.max_length) == ("conv", "human", "gpt", 128)


# -------------------------------------------------------------------------------------------- lora


def _lora_yaml(tmp_path: Path, lora: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello there"}\n')
    tok_dir = _tokenizer_dir(tmp_path)
    return _write(tmp_path, f"""data:
  train_urls: ["{data}"]
  cache_dir: "{tmp_path / 'cache'}"
  tokenizer: "{tok_dir}"
initialize_from_hf: "{_hf_model(tmp_path)}"
max_train_length: 32
{TINY_LLAMA}{lora}""")


def test_lora_keys_and_levanters_defaults(tmp_path: Path) -> None:
    # lora.py:94-99@9263f81e: r 8, alpha 8.0, dropout 0.0
    args = _load(_lora_yaml(tmp_path, "lora:\n  target_modules: [o_proj, down_proj]\n")).args
    assert (args.lora_r, args.lora_alpha, args.lora_dropout) == (8, 8.0, 0.0)
    assert args.lora_target_modules == ["dense", "dense_4h_to_h"]
    assert args.seq_length == 32  # max_train_length (lora_lm.py:74-77)
    args = _load(_lora_yaml(tmp_path, "lora:\n  r: 16\n  alpha: 32\n  dropout: 0.1\n  target_modules: [o_proj]\n")).args
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_scale) == (16, 32.0, 0.1, 2.0)


def test_lora_target_modules_null_adapts_every_linear_layer_as_levanter(tmp_path: Path) -> None:
    """lora.py:95-109@9263f81e: target_modules null matches every hnn.Linear, each with its own LowRankLinear: a
    Llama's q/k/v/o, gate/up/down (llama.py:264-266) and its untied lm_head (llama.py:500-503); both factors drawn
    by haliax's Linear.init (lora.py:148-152)."""
    args = _load(_lora_yaml(tmp_path, "lora:\n  r: 4\n")).args
    assert args.lora_target_modules == ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"]
    assert (args.lora_split_fused, args.lora_init, args.lora_r) == (True, "levanter", 4)
    # named one by one: q/k/v and gate/up are sections of Deepy's fused projections, each its own adapter
    args = _load(_lora_yaml(tmp_path, "lora:\n  target_modules: [q_proj, k_proj, v_proj, up_proj, gate_proj]\n")).args
    assert (args.lora_target_modules, args.lora_split_fused) == (["query_key_value", "dense_h_to_4h"], True)
    # a tied head is the embedding (an hnn.Embedding): null adds nothing for it (llama.py:500-501)
    tied = _lora_yaml(tmp_path, "lora:\n  r: 4\n")
    _hf_model(tmp_path, tie_word_embeddings=True)  # lora_lm.py:62: the HF config decides the head
    assert "output_layer" not in _load(tied).args.lora_target_modules


def test_train_batch_size_minus_one_is_per_device_parallelism_without_accumulation(tmp_path: Path) -> None:
    """trainer.py:922-923,934-935@9263f81e (lora_llama2.yaml's train_batch_size: -1): the batch is
    per_device_parallelism x the data axis; both -1 is Levanter's ValueError."""
    path = _lora_yaml(tmp_path, "lora:\n  target_modules: [o_proj]\n")
    text = path.read_text().replace("  train_batch_size: 4\n", "  train_batch_size: -1\n  per_device_parallelism: 3\n")
    path.write_text(text)
    args = _load(path).args
    assert (args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == (3, 1)
    path.write_text(text.replace("  per_device_parallelism: 3\n", ""))
    with pytest.raises(ConfigError, match="per_device_parallelism must be specified"):
        _load(path)


@pytest.mark.parametrize(("lora", "message"), [
    ("lora:\n  target_modules: [q_proj, v_proj]\n", r"fuses .* without \['k_proj'\]|without \['k_proj'\].* fuses"),
    ("lora:\n  target_modules: '.*proj'\n", "regular expression"),
    ("peft_save_path: out\npeft_hf_upload: me/repo\nlora:\n  target_modules: [o_proj]\n", "uploading PEFT"),
    ("merged_hf_save_path: out\nmerged_hf_upload: me/repo\nlora:\n  target_modules: [o_proj]\n", "merged HF"),
])
def test_lora_refusals(tmp_path: Path, lora: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(_lora_yaml(tmp_path, lora))


def test_peft_save_path_is_levanters_directory_and_interval(tmp_path: Path) -> None:
    # lora_lm.py:42-43,151-158@9263f81e: <peft_save_path>/<trainer.run_id>/step-N every hf_save_steps (default 1000)
    path = _lora_yaml(tmp_path, f"peft_save_path: {tmp_path / 'peft'}\nhf_save_steps: 5\n"
                                "lora:\n  target_modules: [o_proj]\n")
    path.write_text(path.read_text().replace("trainer:\n", "trainer:\n  id: run7\n"))
    args = _load(path).args
    assert args.lora_peft_save_path == str(tmp_path / "peft" / "run7")
    assert (args.lora_peft_save_interval, args.lora_peft_names) == (5, "llama")
    args = _load(_lora_yaml(tmp_path, "lora:\n  target_modules: [o_proj]\n")).args
    assert (args.lora_peft_save_path, args.lora_peft_save_interval) == (None, 1000)


def test_gpt2_lora_targets_map_onto_fused_projections(tmp_path: Path) -> None:
    from megatron.neox_arguments.dialects.common import Context, Leaf
    from megatron.neox_arguments.dialects.levanter_sft import LORA_RULES

    leaves = {"model.type": Leaf("model.type", "gpt2", "f:1")}
    targets = LORA_RULES["lora.target_modules"](["c_attn", "c_proj"], Context(leaves))
    assert targets == {"lora_target_modules": ["query_key_value", "dense", "dense_4h_to_h"]}
    with pytest.raises(Exception, match="PEFT adapters of a gpt2 model"):  # transformers' GPT2 names them otherwise
        LORA_RULES["peft_save_path"]("out", Context({**leaves, "trainer.id": Leaf("trainer.id", "r", "f:2")}))
    # lora_lm.py:56,62@9263f81e: the model is the HF checkpoint's, and Deepy imports no GPT-2 checkpoint
    from transformers import GPT2Config

    path = _lora_yaml(tmp_path, "lora:\n  target_modules: [c_attn, c_proj]\n")
    GPT2Config(n_embd=32, n_layer=2, n_head=4).save_pretrained(tmp_path / "hf_model")
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        _load(path)


def test_chat_urls_glob_like_levanter(tmp_path: Path) -> None:
    from megatron.neox_arguments.dialects.levanter_sft import chat_urls

    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/x.jsonl", "a/b/y.jsonl", "a/b/z.txt"):
        (tmp_path / name).write_text("{}\n")
    assert chat_urls([str(tmp_path / "a" / "**" / "*.jsonl")]) == [str(tmp_path / "a/b/y.jsonl"),
                                                                    str(tmp_path / "a/x.jsonl")]
    assert chat_urls(str(tmp_path / "missing.jsonl")) == [str(tmp_path / "missing.jsonl")]  # refused when checked


def test_a_save_directory_holding_only_the_hf_import_starts_fresh(tmp_path: Path) -> None:
    """Levanter's load = save = base_path/<id>, where deepy.py converts initialize_from_hf (<save>/hf_import): a
    directory holding only that is no checkpoint of the run's own, so the run starts from the import."""
    from megatron.checkpointing.discovery import inspect_load_dir
    from megatron.interop.hf_start import IMPORT_DIR

    (tmp_path / IMPORT_DIR / "global_step0").mkdir(parents=True)
    assert inspect_load_dir(tmp_path).kind == "empty"
    (tmp_path / "stray").mkdir()
    assert inspect_load_dir(tmp_path).kind == "other"


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_an_hf_llama_reads_back_as_converted(kv_heads: int) -> None:
    """The import's model and the one its stored arguments describe agree, also where every query head has its own
    key/value head (Llama-2-7b; the import stopped with 'the stored arguments describe another model')."""
    from transformers import LlamaConfig

    from megatron.interop.deepy_checkpoint import gpt_config_from_args
    from megatron.interop.hf_config import gpt_config_from_hf
    from megatron.interop.yaml_config import architecture_keys

    hf = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv_heads, max_position_embeddings=64)
    config = gpt_config_from_hf(hf)
    assert config.kv_heads == kv_heads
    back = gpt_config_from_args({**architecture_keys(config), "padded_vocab_size": config.padded_vocab_size})
    assert back.replace(precision=config.precision) == config

