"""Data in a bucket (megatron/data/remote_data.py) against a real S3-compatible server (moto's server mode, tests/
s3_server.py): GPT-NeoX's mmap prefixes, Levanter's jsonl shards and fms-fsdp's shard directories read from the
bucket give the same samples as the local files they were uploaded from. The model sees only the samples, so the
same samples give the same losses. Each is downloaded once into the cache, and a path that names nothing is
refused before launch by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron.data.build import build_datasets
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.run_config import data_run
from megatron.tokenizer.char_level import CharLevelTokenizer


def upload(s3_server: Any, bucket: str, local: Path, key: str) -> None:
    s3_server.client().upload_file(str(local), bucket, key)


def samples(splits: Any) -> list[np.ndarray]:
    return [split[i]["text"] for split in (splits.train, splits.valid) if split is not None for i in range(len(split))]


def same_samples(local: NeoXArgs, remote: NeoXArgs) -> None:
    tokenizer = CharLevelTokenizer()
    want = samples(build_datasets(data_run(local), tokenizer, tokenizer.vocab_size))
    got = samples(build_datasets(data_run(remote), tokenizer, tokenizer.vocab_size))
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_dataset_prefix_in_a_bucket_gives_the_local_samples_and_is_downloaded_once(s3_server: Any,
                                                                                     tmp_path: Path) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.data.remote_data import local_copy

    bucket = s3_server.bucket("deepy-data")
    prefix = tmp_path / "local" / "corpus_text_document"
    prefix.parent.mkdir()
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for i in range(40):
        builder.add_item((np.arange(50) * (i + 1)) % 90)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    for ext in (".bin", ".idx"):
        upload(s3_server, bucket, Path(str(prefix) + ext), f"data/corpus_text_document{ext}")
    url = "s3://deepy-data/data/corpus_text_document"
    common = dict(seq_length=16, seed=1, train_batch_size=4, train_iters=5, eval_iters=2, eval_interval=5,
                  split="90,10,0", cache_dir=str(tmp_path / "cache"))
    same_samples(NeoXArgs(data_path=str(prefix), **common), NeoXArgs(data_path=url, **common))
    same_samples(NeoXArgs(train_data_paths=[str(prefix)], valid_data_paths=[str(prefix)], **common),
                 NeoXArgs(train_data_paths=[url], valid_data_paths=[url], **common))

    copy = Path(local_copy(url, str(tmp_path / "cache")))
    assert Path(str(copy) + ".bin").read_bytes() == Path(str(prefix) + ".bin").read_bytes()
    stamp = Path(str(copy) + ".bin").stat().st_mtime_ns
    assert local_copy(url, str(tmp_path / "cache")) == str(copy)  # the same objects: not downloaded again
    assert Path(str(copy) + ".bin").stat().st_mtime_ns == stamp
    upload(s3_server, bucket, Path(str(prefix) + ".idx"), "data/corpus_text_document.bin")  # changed in the bucket
    assert local_copy(url, str(tmp_path / "cache")) != str(copy)


def test_levanter_shards_and_fms_shard_directories_in_a_bucket(s3_server: Any, tmp_path: Path) -> None:
    bucket = s3_server.bucket("deepy-shards")
    local = tmp_path / "local"
    local.mkdir()
    for name, count in (("t1.jsonl", 30), ("t2.jsonl", 20), ("v1.jsonl", 10)):
        (local / name).write_text("".join(json.dumps({"text": f"{name} document {i} " * 3}) + "\n"
                                          for i in range(count)))
        upload(s3_server, bucket, local / name, f"levanter/{name}")
    common = dict(seq_length=16, seed=1, train_batch_size=4, train_iters=5, eval_iters=2, eval_interval=5)
    same_samples(
        NeoXArgs(train_urls=[str(local / "t{1,2}.jsonl")], validation_urls=[str(local / "v1.jsonl")],
                 cache_dir=str(tmp_path / "c1"), **common),
        NeoXArgs(train_urls=["s3://deepy-shards/levanter/t{1,2}.jsonl"],
                 validation_urls=["s3://deepy-shards/levanter/v1.jsonl"], cache_dir=str(tmp_path / "c2"), **common))

    import pyarrow as pa

    shards = tmp_path / "fms" / "corpus"
    shards.mkdir(parents=True)
    schema = pa.schema([("tokens", pa.uint32())])  # fms-fsdp's arrow shard: one record batch per document
    for part in range(2):
        with pa.ipc.new_file(str(shards / f"part{part}.arrow"), schema) as writer:
            for i in range(12):
                doc = list(range(part * 7 + i + 3, part * 7 + i + 43))
                writer.write(pa.record_batch([pa.array(doc, type=pa.uint32())], schema=schema))
        upload(s3_server, bucket, shards / f"part{part}.arrow", f"fms/corpus/part{part}.arrow")
    # fms-fsdp's data_path/<dataset>: what its dialect makes of it (train_data_paths of shard directories)
    same_samples(NeoXArgs(train_data_paths=[str(shards)], cache_dir=str(tmp_path / "c3"), **common),
                 NeoXArgs(train_data_paths=["s3://deepy-shards/fms/corpus"], cache_dir=str(tmp_path / "c4"), **common))


def test_data_that_is_not_there_is_refused_before_launch(s3_server: Any, local_setup_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.app.deepy import DeepyCommand, resolve
    from megatron.config_rules import Device
    from megatron.errors import DeepyError

    s3_server.bucket("deepy-empty")
    monkeypatch.chdir(local_setup_dir)

    def dry_run(*overrides: str) -> None:
        resolve(DeepyCommand("train.py", ["configs/tiny.yml", "configs/local_setup.yml"], list(overrides)),
                device=Device(cuda=False, fp16_supported=False))

    with pytest.raises(DeepyError, match=r"data_path=.*s3://deepy-empty/corpus: no such object in the store"):
        dry_run("data_path=s3://deepy-empty/corpus")
    with pytest.raises(DeepyError, match=r"data_path \(command line\): s3://deepy-gone/corpus: bucket 'deepy-gone' "
                                         r"does not exist"):
        dry_run("data_path=s3://deepy-gone/corpus")
