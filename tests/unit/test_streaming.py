"""Streaming (``streaming``/``stream_shards``, ``megatron/data/streaming.py``) and the offline ``data_shuffle: false``.

References are independent of the streaming code: the offline cache tool (``materialize_urls``) for the token ids,
the offline packed sample index (``GPTDataset`` with ``data_shuffle: false``) for the samples, the stream
definition re-derived here with numpy for S > 1, and an uninterrupted run for every resume.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from megatron.config_rules import Device
from megatron.data.batch import BatchLayout
from megatron.data.build import build_datasets
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.sampler import MicroBatchIterator, Prefetcher
from megatron.data.streaming import StreamingDataset, rank_streams, stream_documents
from megatron.data.url_sources import materialize_urls
from megatron.errors import ConfigError, DataError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.neox_arguments.run_config import data_run
from megatron.tokenizer.char_level import CharLevelTokenizer

TOK = CharLevelTokenizer()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{i}:" + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(1, 40)))) + "é"
            for i in range(n)]


class Counting(CharLevelTokenizer):
    """Records which documents (the number before a text's ':') it tokenized."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def tokenize_batch(self, batch: list[str]) -> list[list[int]]:
        self.seen += [int(t.split(":")[0]) for t in batch]
        return super().tokenize_batch(batch)


def _lines(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _shards(tmp: Path, texts: list[str]) -> list[str]:
    """The texts over a plain, a .gz and a .zst shard (a brace pattern and a plain path)."""
    a, b, c = texts[: len(texts) // 3], texts[len(texts) // 3 : 2 * len(texts) // 3], texts[2 * len(texts) // 3 :]
    (tmp / "s-0.jsonl").write_bytes(_lines(a))
    (tmp / "s-1.jsonl.gz").write_bytes(gzip.compress(_lines(b)))
    (tmp / "t.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(c)))
    return [str(tmp / "s-{0.jsonl,1.jsonl.gz}"), str(tmp / "t.jsonl.zst")]


def _offline_docs(tmp: Path, urls: list[str]) -> list[np.ndarray]:
    ds = MMapIndexedDataset(materialize_urls(urls, str(tmp / "cache"), TOK))
    return [np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))]


def test_jsonl_shards_are_tokenized_as_the_cache_is(tmp_path: Path) -> None:
    urls = _shards(tmp_path, _texts(60))
    got = list(stream_documents(urls, TOK))
    want = _offline_docs(tmp_path, urls)
    assert len(got) == len(want) == 60
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_parquet_arrow_and_a_save_to_disk_directory_are_read(tmp_path: Path) -> None:
    import datasets  # type: ignore[import-untyped]
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(20, seed=1)
    pq.write_table(pa.table({"text": texts, "other": list(range(20))}), tmp_path / "p.parquet", row_group_size=7)
    ids = [[int(i), int(i) + 1, 3] for i in range(5)]
    with pa.ipc.new_file(str(tmp_path / "ids.arrow"), pa.schema([("input_ids", pa.list_(pa.int64()))])) as w:
        w.write_table(pa.table({"input_ids": ids}))
    datasets.Dataset.from_dict({"text": texts[:9]}).save_to_disk(str(tmp_path / "hf"), max_shard_size="1KB")
    want = [np.asarray(TOK.tokenize(t) + [TOK.eod]) for t in texts]  # the tokenizer itself, text by text
    assert [list(d) for d in stream_documents([str(tmp_path / "p.parquet")], TOK)] == [list(w) for w in want]
    assert [list(d) for d in stream_documents([str(tmp_path / "ids.arrow")], TOK)] == ids  # ids read as they are
    assert [list(d) for d in stream_documents([str(tmp_path / "hf")], TOK)] == [list(w) for w in want[:9]]
    # the arrow file datasets writes into its cache (load_dataset of local files; no download), read in place
    (tmp_path / "local.jsonl").write_bytes(_lines(texts[9:]))
    cached = datasets.load_dataset("json", data_files=str(tmp_path / "local.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf_cache"))
    files = [f["filename"] for f in cached.cache_files]
    assert files and all(f.startswith(str(tmp_path / "hf_cache")) for f in files)
    assert [list(d) for d in stream_documents(files, TOK)] == [list(w) for w in want[9:]]


def _offline(tmp: Path, urls: list[str], seq: int, samples: int, shuffle: bool) -> GPTDataset:
    prefix = materialize_urls(urls, str(tmp / "cache"), TOK)
    ds = MMapIndexedDataset(prefix)
    return GPTDataset("train", ds, (0, len(ds)), samples, seq, 1234, prefix=prefix, cache_dir=str(tmp / "cache"),
                      shuffle=shuffle)


def test_one_stream_gives_the_offline_samples_without_shuffle(tmp_path: Path) -> None:
    urls = _shards(tmp_path, _texts(90))
    seq = 16
    offline = _offline(tmp_path, urls, seq, 40, shuffle=False)
    per_epoch = len(offline.shuffle_idx)  # the packed samples of one epoch (the offline index stops at its end)
    stream = StreamingDataset(urls, TOK, seq, 1, 40)
    for i in range(per_epoch):
        assert np.array_equal(stream[i]["text"], offline[i]["text"]), i
    # data_shuffle true (the default): documents and samples permuted from the seed, another order
    shuffled = _offline(tmp_path, urls, seq, 40, shuffle=True)
    assert [shuffled[i]["text"].tobytes() for i in range(per_epoch)] != [offline[i]["text"].tobytes()
                                                                        for i in range(per_epoch)]


def _definition(docs: list[np.ndarray], s: int, streams: int, seq: int, k: int) -> np.ndarray:
    """Sample k of stream s re-derived: documents D = s, s+S, ... (document D mod N) back to back, cut every seq."""
    tokens: list[int] = []
    d = s
    while len(tokens) < (k + 1) * seq + 1:
        tokens += list(docs[d % len(docs)])
        d += streams
    return np.asarray(tokens[k * seq : k * seq + seq + 1])


def test_many_streams_follow_the_definition_across_epochs(tmp_path: Path) -> None:
    urls = _shards(tmp_path, _texts(30))
    docs = _offline_docs(tmp_path, urls)
    seq, streams = 8, 4
    stream = StreamingDataset(urls, TOK, seq, streams, 10)
    total = sum(len(d) for d in docs)
    count = 3 * total // seq  # about three epochs of every stream
    for i in range(count):
        assert np.array_equal(stream[i]["text"], _definition(docs, i % streams, streams, seq, i // streams)), i
    assert stream.documents == 30
    # resumed in the third epoch: whole files before the start are skipped by their counts, D wraps modulo N
    consumed = (count - 40) // streams * streams
    state = stream.state_at(consumed)
    assert min(d for d, _ in state["streams"]) > 2 * 30 + 10  # past two epochs and the first file (10 documents)
    resumed = StreamingDataset(urls, TOK, seq, streams, 10)
    resumed.load_state(json.loads(json.dumps(state)))
    for i in range(consumed, consumed + 40):
        assert np.array_equal(resumed[i]["text"], _definition(docs, i % streams, streams, seq, i // streams)), i


def _read(datasets: list[Any], consumed: int, dp: int, steps: int, g: int = 8, ahead: int = 0) -> list[list[bytes]]:
    """Each step's samples over the dp ranks (rank order) as their micro-batch iterators read them; ``ahead``: micro-
    batches each rank's prefetcher has read past the last step."""
    layout = BatchLayout(micro=2, gas=g // (2 * dp), dp=dp)
    for r, ds in enumerate(datasets):
        ds.read_only(rank_streams(ds.num_streams, g, layout.per_rank, r))
    its = [Prefetcher(MicroBatchIterator(ds, consumed, layout, r), depth=1 + ahead) for r, ds in enumerate(datasets)]
    out = []
    for _ in range(steps):
        step: list[bytes] = []
        for it in its:
            for _ in range(layout.gas):
                step += [row.numpy().tobytes() for row in next(it)["text"]]
        out.append(step)
    return out


@pytest.mark.parametrize("streams", [8, 2, 1])
def test_a_resume_at_another_dp_reads_the_uninterrupted_samples(tmp_path: Path, streams: int) -> None:
    """dp 2 for 3 steps (the prefetchers a micro-batch ahead), its state gathered as the ranks would, then dp 1 (a tp
    change that halves dp) and dp 4 from that state: the samples of the uninterrupted dp-1 run, step for step."""
    urls = _shards(tmp_path, _texts(40))

    def fresh(tok: CharLevelTokenizer = TOK) -> StreamingDataset:
        return StreamingDataset(urls, tok, 8, streams, 96, checkpoint_every=8 // streams)

    whole = _read([fresh()], 0, 1, 9)
    ranks = [fresh(), fresh()]
    assert _read(ranks, 0, 2, 3, ahead=1) == whole[:3]
    state = ranks[0].state_at(24, [ranks[1].local_state(24)], [ranks[1].documents])
    state = json.loads(json.dumps(state))  # as the checkpoint holds it
    for dp in (1, 4):
        toks = [Counting() for _ in range(dp)]
        resumed = [fresh(tok) for tok in toks]
        for ds in resumed:
            ds.load_state(state)
        assert _read(resumed, 24, dp, 6) == whole[3:], dp
        # O(1): no document before the saved positions is tokenized again (a replay would start at document 0)
        starts = [d for d, _ in state["streams"]]
        assert any(d > s for s, d in enumerate(starts))  # the streams have moved past their first documents
        assert all(d >= starts[d % streams] for tok in toks for d in tok.seen)
    with pytest.raises(DataError, match="stream_shards"):
        StreamingDataset(urls, TOK, 8, 16 if streams != 16 else 8, 96).load_state(state)


def test_no_document_is_read_twice_or_missed_across_ranks(tmp_path: Path) -> None:
    """stream_shards = the global batch, dp 2: each rank tokenizes only its streams' documents (rank 0 streams 0-3,
    rank 1 streams 4-7), and the two ranks together tokenize every document read so far exactly once."""
    (tmp_path / "a.jsonl").write_bytes(_lines(_texts(300, seed=3)))
    toks = [Counting(), Counting()]
    datasets = [StreamingDataset([str(tmp_path / "a.jsonl")], t, 4, 8, 32, checkpoint_every=1) for t in toks]
    _read(datasets, 0, 2, 2)
    read = len(toks[0].seen) + len(toks[1].seen)
    assert 0 < read < 300  # a bounded read-ahead (one batch of documents), not the whole file
    assert toks[0].seen == [d for d in range(2 * read) if d % 8 < 4][: len(toks[0].seen)]
    assert toks[1].seen == [d for d in range(2 * read) if d % 8 >= 4][: len(toks[1].seen)]
    assert sorted(toks[0].seen + toks[1].seen) == list(range(read))


def test_build_datasets_streams_train_urls(tmp_path: Path) -> None:
    urls = _shards(tmp_path, _texts(40))
    args = NeoXArgs(seq_length=8, seed=1, train_batch_size=8, train_iters=4, eval_iters=0, eval_interval=100,
                    train_urls=urls, streaming=True, stream_shards=2)
    splits = build_datasets(data_run(args), TOK, 256)
    assert splits.train is not None
    assert np.array_equal(splits.train[5]["text"], StreamingDataset(urls, TOK, 8, 2, 32)[5]["text"])
    assert len(splits.train) == 32 and not (tmp_path / "cache").exists()


# ---- checks before launch -------------------------------------------------------------------------------------
BASE: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "train_iters": 10, "lr": 1e-3,
                        "tokenizer_type": "CharLevelTokenizer"}


def finalized(tmp_path: Path, **values: Any) -> NeoXArgs:
    (tmp_path / "a.jsonl").write_bytes(_lines(["abc"]))
    merged = {**BASE, "train_urls": [str(tmp_path / "a.jsonl")], "streaming": True, **values}
    provenance = {key: f"cfg.yml:{line}" for line, key in enumerate(merged, start=1)}
    return finalize(ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance), 2,
                    device=Device(cuda=False, fp16_supported=False)).args


def test_a_streamed_run_passes_the_checks_without_a_cache(tmp_path: Path) -> None:
    assert finalized(tmp_path, stream_shards=4).stream_shards == 4


@pytest.mark.parametrize("values,key,words", [
    (dict(stream_shards=3), "stream_shards", "does not divide the global batch"),
    (dict(streaming=False, stream_shards=2, cache_dir="c"), "stream_shards", "set streaming: true"),
    (dict(pack_impl="unpacked"), "pack_impl", "use pack_impl: packed"),
    (dict(train_batch_size_schedule=[{"start_step": 0, "global_batch": 8}]), "train_batch_size_schedule",
     "one global batch size"),
    (dict(train_urls=None, data_path="x"), "streaming", "reads train_urls, which is not set"),
    (dict(streaming=False, data_shuffle=False, train_impl="dpo", cache_dir="c"), "data_shuffle",
     "always shuffled from the seed"),
    (dict(streaming=False, data_shuffle=100, train_impl="kto", cache_dir="c"), "data_shuffle",
     "in eras of 100 samples"),
    (dict(streaming=False, data_shuffle=1, cache_dir="c"), "data_shuffle", "give 2 or more"),
    (dict(data_shuffle=100), "data_shuffle", "eras would send every rank into every stream"),
])
def test_bad_streaming_configs_are_refused_before_launch_by_name(tmp_path: Path, values: dict[str, Any], key: str,
                                                                words: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as err:
        finalized(tmp_path, **values)
    message = getattr(err.value, "message", str(err.value))
    assert key in message and words in message, message
