"""Levanter's mixtures of named sources (``data.configs`` + ``data.train_weights``, ``LMMixtureDatasetConfig``) load to
``train_data_paths``/``valid_data_paths``/``train_data_weights_schedule``/``mixture_block_size`` and read as Levanter
reads them.

Expected values come from Levanter's code at 9263f81e, not from Deepy's output: the sources a training mixture reads
are those with a positive weight in some stage, in ``data.configs``' order (``text.py:1332-1342``,
``mixture.py:83-88``); every source with validation urls is evaluated (``text.py:1301-1305``); a block of
``mixture_block_size`` samples holds ``int(w * block)`` of each source, the remainder to the largest
(``mixture.py:138-155``), re-derived below; the stage starts are the steps' data offsets (``mixture.py:310-340``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron.config_rules import Device
from megatron.data.build import build_datasets
from megatron.errors import ConfigError
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.dialects import split_argv
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.run_config import data_run
from megatron.tokenizer.build import build_tokenizer

MIXTURE = """\
data:
  tokenizer: "{root}/tokenizer.json"
  cache_dir: "{root}/cache"
  configs:
    web:
      train_urls:
        - "{root}/web.{{1..2}}.jsonl"
        - "{root}/web_extra.jsonl"
      validation_urls: ["{root}/web_val.jsonl"]
      tags: [crawl]
    code:
      train_urls: ["{root}/code.jsonl"]
    paloma:
      validation_urls: ["{root}/paloma_val.jsonl"]
  train_weights:
    - [0, {{"code": 0.25, "web": 0.75}}]
    - [{boundary}, {{"web": 0.25, "code": 0.75}}]
  mixture_block_size: 16
  stop_strategy: restart
model:
  type: gpt2
  hidden_dim: 32
  num_heads: 4
  num_layers: 2
  seq_len: 8
trainer:
  train_batch_size: 8
  num_train_steps: 12
  per_device_parallelism: 8
"""

WORDS = {"web": "w1", "web_extra": "w1", "code": "w2"}
"""Each training source's documents repeat one word, so a sample tells which named source it came from."""


def write_sources(root: Path) -> None:
    import tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(6)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    files = {"web.1": "w1", "web.2": "w1", "web_extra": "w1", "code": "w2", "web_val": "w3", "paloma_val": "w4"}
    for name, word in files.items():
        rows = [{"text": " ".join([word] * (5 + i % 7))} for i in range(30)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def load(tmp_path: Path, text: str, *flags: str) -> Any:
    if not (tmp_path / "tokenizer.json").exists():
        (tmp_path / "tokenizer.json").write_text("{}")  # read only by build_tokenizer, which these loads do not run
    config = tmp_path / "run.yaml"
    config.write_text(text)
    _, parsed = split_argv(["--config_path", str(config), *flags])
    return load_config([], (), None, parsed)


def mixture(tmp_path: Path, boundary: int = 6, replace: dict[str, str] | None = None) -> str:
    text = MIXTURE.format(root=tmp_path, boundary=boundary)
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_named_sources_become_paths_and_a_weight_schedule(tmp_path: Path) -> None:
    args = load(tmp_path, mixture(tmp_path)).args
    # weighted sources in data.configs' order (web before code, whatever the weights' order); several urls: one
    # brace pattern ending in the shards' suffix; paloma has no weight: evaluated only
    web = f"{{{tmp_path}/web.{{1..2}},{tmp_path}/web_extra}}.jsonl"
    assert args.train_data_paths == [web, f"{tmp_path}/code.jsonl"]
    assert args.valid_data_paths == [f"{tmp_path}/web_val.jsonl", f"{tmp_path}/paloma_val.jsonl"]
    assert [list(stage) for stage in args.train_data_weights_schedule] == [[0, [0.75, 0.25]], [6, [0.25, 0.75]]]
    assert args.mixture_block_size == 16 and args.train_data_weights is None


def test_a_constant_dict_is_one_stage_and_keeps_levanters_block_rounding(tmp_path: Path) -> None:
    """A dict is Levanter's MixtureDataset too (weight_stages = [(0, weights)], mixture.py:61-62), so its block
    rounding holds: GPT-NeoX's blend (train_data_weights) would not round a small weight to 0 per block."""
    stages = '    - [0, {"code": 0.25, "web": 0.75}]\n    - [6, {"web": 0.25, "code": 0.75}]'
    text = mixture(tmp_path, replace={stages: '    {"web": 3, "code": 1, "paloma": 0}'})
    args = load(tmp_path, text).args
    assert [list(stage) for stage in args.train_data_weights_schedule] == [[0, [3.0, 1.0]]]
    assert len(args.train_data_paths) == 2
    # a source weightless in every stage is not read for training (text.py:1341; mixture.py:83-88)
    text = text.replace('"code": 1', '"code": 0')
    assert load(tmp_path, text).args.train_data_paths == [f"{{{tmp_path}/web.{{1..2}},{tmp_path}/web_extra}}.jsonl"]


def levanter_block_counts(weights: list[float], block: int) -> list[int]:
    """mixture.py:138-155@9263f81e, re-derived: normalised weights, int32 truncation, the remainder to argmax."""
    norm = [w / sum(weights) for w in weights]
    counts = [int(w * block) for w in norm]
    counts[int(np.argmax(counts))] += block - sum(counts)
    return counts


def test_the_loaded_mixture_reads_each_named_source_in_levanters_counts(tmp_path: Path) -> None:
    write_sources(tmp_path)
    resolved = finalize(load(tmp_path, mixture(tmp_path)), 1, device=Device(cuda=False, fp16_supported=False))
    args = resolved.args
    splits = build_datasets(data_run(args), build_tokenizer(args), 256)
    train = splits.train
    assert train is not None
    word_id = {"w1": 3, "w2": 4}
    source_of_token = {word_id[WORDS["web"]]: "web", word_id[WORDS["code"]]: "code"}
    block, per_stage = 16, {0: levanter_block_counts([0.75, 0.25], 16), 1: levanter_block_counts([0.25, 0.75], 16)}
    for b in range(6):  # 96 samples = 12 steps of 8; step 6 is sample 48, block 3
        names = []
        for i in range(b * block, (b + 1) * block):
            tokens = [int(t) for t in train[i]["text"] if int(t) in source_of_token]
            assert len({source_of_token[t] for t in tokens}) == 1, tokens  # one named source per sample
            names.append(source_of_token[tokens[0]])
        want = per_stage[0 if b < 3 else 1]
        assert [names.count("web"), names.count("code")] == want, b
    # both validation sources are evaluated (w3 and w4: web's and paloma's validation words)
    valid = splits.valid
    assert valid is not None
    seen = {int(t) for i in range(len(valid)) for t in valid[i]["text"]}
    assert {5, 6} <= seen


def test_a_boundary_off_the_block_is_refused_by_levanters_key(tmp_path: Path) -> None:
    """Levanter's own gpt2_nano_mixture.yaml has this shape: step 100 x batch 32 = sample 3200, not a multiple of
    the default block of 2048, which MixtureDataset asserts (mixture.py:74-77)."""
    write_sources(tmp_path)
    with pytest.raises(ConfigError) as err:
        finalize(load(tmp_path, mixture(tmp_path, boundary=5)), 1, device=Device(cuda=False, fp16_supported=False))
    assert "data.train_weights" in err.value.message and "not a multiple of the block of 16" in err.value.message


@pytest.mark.parametrize("old,new,words", [
    ('"code": 0.75}]', '"code": 0.75, "books": 1}]', "data.configs does not name"),
    ("- [6, ", "- [-1, ", "negative step"),
    ("stop_strategy: restart", "stop_strategy: first_exhausted", "NotImplementedError"),
    ("stop_strategy: restart", "stop_strategy: all_exhausted", "NotImplementedError"),
    ("stop_strategy: restart", "max_train_batches: {web: 2}", "per-source cut is not built"),
    ("stop_strategy: restart", "num_validation_sequences: {web: 2}", "give the source validation_urls"),
    ("stop_strategy: restart", "target_budget: 1000", "simulated epoching"),
    ("stop_strategy: restart", "experiment_budget: 100", "simulated epoching"),
    ('train_urls: ["ROOT/code.jsonl"]', "id: dlwh/wikitext_103_detokenized", "would be downloaded"),
    ("tags: [crawl]", "format: {type: chat}", "chat and supervised formats"),
    ("tags: [crawl]", "train_split: x", "not fields of Levanter's UrlDatasetSourceConfig"),
    ('train_urls: ["ROOT/code.jsonl"]', "cache_dir: /prebuilt", "has a weight but no train_urls"),
    ('"ROOT/code.jsonl"', '"ROOT/code.parquet"', "jsonl shards"),
    ("  mixture_block_size: 16", '  mixture_block_size: 16\n  train_urls: ["ROOT/x.jsonl"]', "beside data.configs"),
])
def test_what_is_not_built_is_refused_by_name(tmp_path: Path, old: str, new: str, words: str) -> None:
    text = mixture(tmp_path, replace={old.replace("ROOT", str(tmp_path)): new.replace("ROOT", str(tmp_path))})
    with pytest.raises(ConfigError, match="levanter key data[.]") as err:
        load(tmp_path, text)
    assert words in err.value.message, err.value.message


def test_weights_without_sources_and_sources_without_weights_are_refused(tmp_path: Path) -> None:
    no_weights = "\n".join(line for line in mixture(tmp_path).splitlines()
                           if "train_weights" not in line and not line.startswith("    - ["))
    with pytest.raises(ConfigError, match="Datasets cannot be empty"):
        load(tmp_path, no_weights + "\n")
    weights_only = ('data:\n  tokenizer: "{0}/tokenizer.json"\n  train_urls: ["{0}/a.jsonl"]\n'
                    "  train_weights: {{a: 1}}\n")
    with pytest.raises(ConfigError, match="data.configs, which is not set"):
        load(tmp_path, weights_only.format(tmp_path))


def test_a_flag_adds_a_source_and_replaces_the_weights(tmp_path: Path) -> None:
    args = load(tmp_path, mixture(tmp_path), f"--data.configs.books.train_urls=[{tmp_path}/books.jsonl.zst]",
                "--data.train_weights={web: 1, books: 1}").args
    assert args.train_data_paths[1:] == [f"{tmp_path}/books.jsonl.zst"]
    assert [list(stage) for stage in args.train_data_weights_schedule] == [[0, [1.0, 1.0]]]


@pytest.mark.parametrize("ray,address", [
    ("{address: 'head:6379'}", "head:6379"),  # RayConfig joins the cluster at address (distributed.py:382-384)
    ("{address: 'head:6379', auto_start_cluster: false}", None),  # ... only when auto_start_cluster
    ("{start_workers: true}", None),  # no address: nothing to join; the ranks are Deepy's launcher's
])
def test_trainer_ray_address_tokenizes_the_cache_on_that_cluster(tmp_path: Path, ray: str, address: str | None) -> None:
    text = mixture(tmp_path, replace={"  per_device_parallelism: 8": f"  per_device_parallelism: 8\n  ray: {ray}"})
    assert load(tmp_path, text).args.tokenize_ray_address == address
    with pytest.raises(ConfigError, match="not fields of Levanter's RayConfig"):
        load(tmp_path, mixture(tmp_path, replace={"  per_device_parallelism: 8": "  per_device_parallelism: 8\n"
                                                                                 "  ray: {head: x}"}))


def test_shuffle_false_reads_in_file_order_and_eras_are_refused(tmp_path: Path) -> None:
    """LMTaskConfig.shuffle (text.py:537@9263f81e): false = the data in order (data_shuffle false), true = shuffled
    (Deepy's own permutation), an integer = eras of that many sequences (data_shuffle: N, permutation.py:61-110)."""
    base = mixture(tmp_path)
    assert load(tmp_path, base.replace("  stop_strategy: restart", "  shuffle: false")).args.data_shuffle is False
    assert load(tmp_path, base.replace("  stop_strategy: restart", "  shuffle: true")).args.data_shuffle is True
    # left out: LMTaskConfig's default, False (text.py:537) - Levanter's train_lm.py reads in order, and so does Deepy
    assert "shuffle:" not in base
    assert load(tmp_path, base).args.data_shuffle is False
    assert load(tmp_path, base.replace("  stop_strategy: restart", "  shuffle: 10000")).args.data_shuffle == 10000
    assert load(tmp_path, base.replace("  stop_strategy: restart", "  shuffle: 1")).args.data_shuffle is False
    with pytest.raises(ConfigError, match="not with Levanter's linear or Feistel"):
        load(tmp_path, base.replace("  stop_strategy: restart", "  shuffle: true\n  permutation_type: feistel"))
