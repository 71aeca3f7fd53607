"""Levanter's configs name Hugging Face hub models and gs:// buckets; they load as a Levanter user expects.

Hub names (``initialize_from_hf: meta-llama/Llama-3.1-8B``, ``model_name_or_path``, ``tokenizer``, the model type's
default ``reference_checkpoint``) are read from this machine's hub cache, the directory ``hf download`` fills; the
cache here is written by hand in huggingface_hub's layout, and huggingface_hub's own ``snapshot_download`` (offline)
reads it as the download it stands for. gs:// checkpoint and HF-save paths go through gcsfs (a requirement); reading a
config makes no client (the bucket is probed before launch). Nothing here reaches the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron import object_store
from megatron.errors import ConfigError
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import load_config

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "vocab_size": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False}


def cache_repo(hub: Path, name: str, files: dict[str, str], commit: str, ref: str | None = "main") -> Path:
    """``hf download name`` as it leaves the hub cache: ``models--org--name/snapshots/<commit>/<file>``, and
    ``refs/<ref>`` holding the commit (huggingface_hub's file_download.py layout)."""
    repo = hub / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for filename, text in files.items():
        (snapshot / filename).write_text(text)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def load(tmp_path: Path, text: str) -> Any:
    config = tmp_path / "run.yaml"
    config.write_text(text)
    _, parsed = split_argv(["--config_path", str(config)])
    return load_config([], (), None, parsed)


def test_hub_names_are_read_from_the_local_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    main = cache_repo(hub, "org/tiny-llama", {"config.json": json.dumps(TINY), "tokenizer.json": "{}"}, "a" * 40)
    pinned = cache_repo(hub, "org/tiny-llama", {"config.json": json.dumps({**TINY, "hidden_size": 32}),
                                                "tokenizer.json": "{}"}, "b" * 40, ref=None)
    default = cache_repo(hub, "NousResearch/Llama-2-7b-hf", {"config.json": json.dumps({**TINY, "hidden_size": 64})},
                         "c" * 40)
    # the layout is the one huggingface_hub (which writes the cache) reads offline as that download
    from huggingface_hub import snapshot_download

    assert snapshot_download("org/tiny-llama", cache_dir=hub, local_files_only=True) == str(main)
    assert snapshot_download("org/tiny-llama", revision="b" * 40, cache_dir=hub, local_files_only=True) == str(pinned)

    data = f'data:\n  train_urls: ["{tmp_path}/a.jsonl"]\n  tokenizer: org/tiny-llama\nmodel:\n  type: llama\n'
    # train_lm.py:93-96@9263f81e: with use_hf_model_config the model is config.json's
    a = load(tmp_path, data + "initialize_from_hf: org/tiny-llama\nuse_hf_model_config: true\n").args
    assert (a.initialize_from_hf, a.vocab_file) == (str(main), str(main / "tokenizer.json"))
    assert (a.hidden_size, a.num_kv_heads, a.ffn_hidden_size) == (48, 2, 96)
    # RepoRef.from_string (hf_checkpoints.py:105-109): name@revision
    a = load(tmp_path, data + f"initialize_from_hf: org/tiny-llama@{'b' * 40}\nuse_hf_model_config: true\n").args
    assert (a.initialize_from_hf, a.hidden_size) == (str(pinned), 32)
    # true reads the model type's reference_checkpoint: LlamaConfig's NousResearch/Llama-2-7b-hf (llama.py:80), as
    # Levanter's llama2_7b_continued.yaml does
    a = load(tmp_path, data + "initialize_from_hf: true\nuse_hf_model_config: true\n").args
    assert (a.initialize_from_hf, a.hidden_size) == (str(default), 64)
    # not in the cache: refused by key and line, with the command that fetches it
    with pytest.raises(ConfigError, match=r"initialize_from_hf = 'org/absent' at .*run.yaml:6: 'org/absent' is a "
                                          r"Hugging Face hub name .*not in this machine's hub cache .*"
                                          r"hf download org/absent\)"):
        load(tmp_path, data + "initialize_from_hf: org/absent\n")
    with pytest.raises(ConfigError, match=r"data.tokenizer .*'org/absent' is a Hugging Face hub name whose "
                                          r"tokenizer.json"):
        load(tmp_path, data.replace("tokenizer: org/tiny-llama", "tokenizer: org/absent"))


def test_sft_model_and_tokenizer_hub_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sft.py:114-123@9263f81e: initialize_from_hf: true reads model_name_or_path (its model is config.json's,
    seq_len max_seq_len); the top-level tokenizer names the hub too (Levanter's sft_llama3_mixture.yaml)."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    model = cache_repo(hub, "meta-llama/Llama-3.1-8B", {"config.json": json.dumps(TINY)}, "d" * 40)
    tok = cache_repo(hub, "meta-llama/Llama-3.1-8B-Instruct", {"tokenizer.json": "{}"}, "e" * 40)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]}) + "\n")
    a = load(tmp_path, f'dataset_type: chat_jsonl\nchat_train_urls: ["{chats}"]\nsupervised_data:\n'
                       f'  cache_dir: "{tmp_path}/cache"\nmax_seq_len: 32\ntokenizer: meta-llama/Llama-3.1-8B-Instruct\n'
                       f'initialize_from_hf: true\nmodel_name_or_path: meta-llama/Llama-3.1-8B\n').args
    assert (a.initialize_from_hf, a.vocab_file) == (str(model), str(tok / "tokenizer.json"))
    assert (a.hidden_size, a.num_layers, a.seq_length) == (48, 2, 32)


def test_gs_checkpoint_and_hf_save_paths_load_without_a_client(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """llama2_7b.yaml's gs:// base_path and the SFT configs' gs:// hf_save_path: gcsfs is installed (a
    requirement), so they load; reading the config makes no gcsfs client (its constructor looks for credentials,
    up to the GCE metadata server) - the bucket is probed before launch (test_object_store.py)."""
    def no_client(self: Any, scheme: str) -> None:
        raise AssertionError(f"a {scheme}:// client was made while the config was read")

    monkeypatch.setattr(object_store.FsspecStore, "__init__", no_client)
    (tmp_path / "tokenizer.json").write_text("{}")
    a = load(tmp_path, f'data:\n  train_urls: ["gs://bucket/train.jsonl"]\n  tokenizer: {tmp_path}/tokenizer.json\n'
                       "model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"
                       "trainer:\n  id: r1\n  checkpointer:\n    base_path: gs://bucket/ckpts\n"
                       "hf_save_path: gs://bucket/hf\n").args
    assert (a.save, a.load, a.hf_save_path) == ("gs://bucket/ckpts/r1", "gs://bucket/ckpts/r1", "gs://bucket/hf/r1")
    assert a.train_urls == ["gs://bucket/train.jsonl"]
