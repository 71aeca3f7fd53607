"""Levanter-style URL sources: brace expansion, tokenize-once cache keyed by content."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.url_sources import expand_braces, expand_urls, materialize_urls
from megatron.errors import DataError
from megatron.tokenizer.char_level import CharLevelTokenizer


def test_brace_expansion() -> None:
    assert expand_braces("s{1..3}.jsonl") == ["s1.jsonl", "s2.jsonl", "s3.jsonl"]
    assert expand_braces("s{08..11}") == ["s08", "s09", "s10", "s11"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert expand_braces("x{a,b{1,2}}y") == ["xay", "xb1y", "xb2y"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("{0..6..3}") == ["0", "3", "6"]
    assert expand_braces("plain.jsonl") == ["plain.jsonl"]
    assert len(expand_braces("shard-{1..128}.jsonl.gz")) == 128
    with pytest.raises(DataError):
        expand_braces("a{1,2")
    with pytest.raises(DataError):
        expand_braces("a{single}")


def _shard(path: Path, texts: list[str]) -> None:
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def test_materialize_tokenizes_once_and_keys_by_content(tmp_path: Path) -> None:
    _shard(tmp_path / "s1.jsonl", ["ab", "cde"])
    _shard(tmp_path / "s2.jsonl.gz", ["f"])
    tok = CharLevelTokenizer()
    urls = [str(tmp_path / "s{1,2}.jsonl") + "{,.gz}"]
    with pytest.raises(DataError):  # s1.jsonl.gz / s2.jsonl do not exist
        expand_urls(urls)
    urls = [str(tmp_path / "s1.jsonl"), str(tmp_path / "s{2..2}.jsonl.gz")]
    cache = tmp_path / "cache"
    prefix = materialize_urls(urls, str(cache), tok)
    ds = MMapIndexedDataset(prefix)
    assert [list(ds[i]) for i in range(len(ds))] == [[97, 98, 0], [99, 100, 101, 0], [102, 0]]
    mtime = Path(prefix + ".idx").stat().st_mtime_ns
    assert materialize_urls(urls, str(cache), tok) == prefix
    assert Path(prefix + ".idx").stat().st_mtime_ns == mtime  # reused, not rebuilt
    _shard(tmp_path / "s1.jsonl", ["ab", "cdX"])  # same name, new content
    prefix2 = materialize_urls(urls, str(cache), tok)
    assert prefix2 != prefix
    assert list(MMapIndexedDataset(prefix2)[1]) == [99, 100, 88, 0]


def test_bad_shards(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        materialize_urls([str(tmp_path / "bad.jsonl")], str(tmp_path / "c"), CharLevelTokenizer())
    assert not list((tmp_path / "c").glob("*.idx"))
    with pytest.raises(DataError, match="local files or objects in a bucket"):
        expand_urls(["https://example.com/a.jsonl"])


def test_build_datasets_from_urls(tmp_path: Path) -> None:
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run

    _shard(tmp_path / "t1.jsonl", [f"document number {i} " * 3 for i in range(30)])
    _shard(tmp_path / "v1.jsonl", [f"held out {i}" for i in range(10)])
    config = NeoXArgs(seq_length=16, seed=1, train_batch_size=4, train_iters=5, eval_iters=2,
                        eval_interval=5, train_urls=[str(tmp_path / "t{1..1}.jsonl")],
                        validation_urls=[str(tmp_path / "v1.jsonl")], cache_dir=str(tmp_path / "cache"))
    tokenizer = CharLevelTokenizer()
    splits = build_datasets(data_run(config), tokenizer, tokenizer.vocab_size)
    assert len(splits.train) == 20 and len(splits.valid) == 16 and splits.test is None
    s = splits.train[3]["text"]
    assert s.shape == (17,) and s.dtype == np.int64
