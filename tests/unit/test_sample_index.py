"""Sample index: coverage within an epoch, determinism, packing modes, speed, real MMIDIDX files."""

from __future__ import annotations

import time

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.sample_index import build_packed_index, build_sample_index, packed_samples_per_epoch
from megatron.errors import DataError


class PositionCorpus:
    """Documents whose tokens are their global token positions, so samples reveal what they cover."""

    def __init__(self, sizes: list[int] | np.ndarray) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        length = int(self.sizes[idx]) - offset if length is None else length
        assert 0 <= offset and offset + length <= self.sizes[idx]
        s = int(self.starts[idx]) + offset
        return np.arange(s, s + length, dtype=np.int64)


def _corpus(seed: int = 0, n: int = 60) -> PositionCorpus:
    sizes = np.random.default_rng(seed).integers(0, 40, n)  # includes empty documents
    return PositionCorpus(sizes)


@pytest.mark.parametrize("seq_length", [1, 7, 16, 33])
def test_every_token_appears_once_per_epoch(seq_length: int) -> None:
    corpus = _corpus()
    total = int(corpus.sizes.sum())
    spe = packed_samples_per_epoch(total, seq_length)
    ds = GPTDataset("train", corpus, (0, len(corpus.sizes)), 3 * spe, seq_length, seed=5)
    for epoch in range(3):
        seen = np.zeros(total, dtype=np.int64)
        for i in range(epoch * spe, (epoch + 1) * spe):
            text = ds[i]["text"]
            assert text.shape == (seq_length + 1,) and text.dtype == np.int64
            seen[text[:-1]] += 1  # the last token is shared with the next sample of the stream
        # Each token position once, except the tail that does not fill a whole sample.
        tail = (total - 1) % seq_length
        assert np.sum(seen == 1) == total - 1 - tail
        assert seen.max() == 1
        assert np.sum(seen == 0) == tail + 1


def test_samples_are_contiguous_stream_pieces() -> None:
    corpus = _corpus(1)
    ds = GPTDataset("train", corpus, (0, len(corpus.sizes)), 50, 8, seed=3)
    docs_of = np.repeat(np.arange(len(corpus.sizes)), corpus.sizes)
    for i in range(50):
        spans = ds.spans(i)
        assert sum(length for _, _, length in spans) == 9
        # Within a sample a document piece is contiguous; consecutive pieces are distinct docs.
        text = ds[i]["text"]
        assert len(set(docs_of[text])) == len(spans)


def test_order_is_pure_function_of_seed_and_independent_of_num_samples() -> None:
    sizes = np.random.default_rng(2).integers(1, 50, 100)
    a = build_packed_index(sizes, 16, seed=7, num_samples=10)
    b = build_packed_index(sizes, 16, seed=7, num_samples=10_000)  # many more epochs
    n = len(a["shuffle_idx"])
    rows_a = a["sample_idx"][a["shuffle_idx"]]
    rows_b = b["sample_idx"][b["shuffle_idx"][:n]]
    assert np.array_equal(a["doc_idx"], b["doc_idx"][: len(a["doc_idx"])])
    assert np.array_equal(rows_a, rows_b)
    c = build_packed_index(sizes, 16, seed=8, num_samples=10)
    assert not np.array_equal(c["shuffle_idx"], a["shuffle_idx"]) or not np.array_equal(c["doc_idx"], a["doc_idx"])
    assert len(b["shuffle_idx"]) >= 10_000


def test_documents_are_shuffled_differently_per_epoch() -> None:
    sizes = np.full(200, 10)
    idx = build_packed_index(sizes, 10, seed=1, num_samples=600)
    e0, e1 = idx["doc_idx"][:200], idx["doc_idx"][200:400]
    assert sorted(e0) == list(range(200)) and sorted(e1) == list(range(200))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, np.arange(200))


def test_large_corpus_indexes_in_seconds() -> None:
    sizes = np.random.default_rng(0).integers(1, 2000, 100_000)  # ~1e8 tokens
    assert sizes.sum() > 9e7
    t0 = time.perf_counter()
    idx = build_packed_index(sizes, 2048, seed=1, num_samples=200_000)
    elapsed = time.perf_counter() - t0
    assert len(idx["shuffle_idx"]) >= 200_000
    assert elapsed < 10, f"indexing 1e8 tokens took {elapsed:.1f}s"


def test_unpacked_one_document_per_sample_with_padding_masked() -> None:
    corpus = PositionCorpus([3, 0, 12, 5])
    ds = GPTDataset("train", corpus, (0, 4), 6, 7, seed=0, pack_impl="unpacked", pad_id=99)
    for i in range(6):
        s = ds[i]
        assert s["text"].shape == (8,) and s["label"].shape == (8,)
        pad = s["label"] == -100
        assert np.all(s["text"][pad] == 99)
        real = s["text"][~pad]
        # One whole document (the 12-token one truncated to 8).
        assert len(real) in (3, 5, 8)


def test_pack_until_overflow_keeps_documents_whole() -> None:
    sizes = [4, 4, 4, 20, 3, 2]
    corpus = PositionCorpus(sizes)
    docs_of = np.repeat(np.arange(len(sizes)), sizes)
    for chopped in (True, False):
        idx = build_sample_index(np.array(sizes), 9, 0, 1, "pack_until_overflow", chopped)
        rows = idx["sample_idx"][: len(idx["sample_idx"])]
        ds = GPTDataset("t", corpus, (0, 6), len(rows), 9, 0, "pack_until_overflow", chopped)
        long_seen = False
        for i in range(len(rows)):
            s = ds[i]
            real = s["text"][s["label"] != -100]
            docs = set(docs_of[real])
            for d in docs:
                n_in = int(np.sum(docs_of[real] == d))
                if sizes[d] > 10:
                    long_seen = True
                    assert n_in == 10
                else:
                    assert n_in == sizes[d]
        assert long_seen == chopped


def test_bad_inputs_raise_data_error() -> None:
    with pytest.raises(DataError):
        build_packed_index(np.array([3]), 8, 0, 1)  # fewer tokens than one sample
    with pytest.raises(DataError):
        build_packed_index(np.array([], dtype=np.int64), 8, 0, 1)
    with pytest.raises(DataError):
        GPTDataset("t", PositionCorpus([5, 5]), (1, 1), 1, 2, 0)


def _write(prefix: str, docs: list[list[int]]) -> None:
    b = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for d in docs:
        b.add_item(np.array(d))
        b.end_document()
    b.finalize(prefix + ".idx")


def test_real_files_and_cache_keyed_by_content(tmp_path) -> None:
    prefix = str(tmp_path / "corpus_text_document")
    docs = [[i % 50 + 1] * (5 + i % 7) for i in range(40)]
    _write(prefix, docs)
    cache = tmp_path / "cache"
    ds = GPTDataset("train", MMapIndexedDataset(prefix), (0, 40), 20, 8, 1, prefix=prefix, cache_dir=str(cache))
    files = sorted(p.name for p in cache.glob("*.deepyidx"))
    assert len(files) == 1
    first = [ds[i]["text"].copy() for i in range(20)]
    # Same name, same parameters: the cache is reused.
    ds2 = GPTDataset("train", MMapIndexedDataset(prefix), (0, 40), 20, 8, 1, prefix=prefix, cache_dir=str(cache))
    assert sorted(p.name for p in cache.glob("*.deepyidx")) == files
    assert all(np.array_equal(a, ds2[i]["text"]) for i, a in enumerate(first))
    # Same name, different content: a new cache file.
    _write(prefix, [d + [7] for d in docs])
    GPTDataset("train", MMapIndexedDataset(prefix), (0, 40), 20, 8, 1, prefix=prefix, cache_dir=str(cache))
    assert len(list(cache.glob("*.deepyidx"))) == 2
    # Different seq_length or split range: new cache files too.
    GPTDataset("train", MMapIndexedDataset(prefix), (0, 30), 20, 8, 1, prefix=prefix, cache_dir=str(cache))
    GPTDataset("train", MMapIndexedDataset(prefix), (0, 30), 20, 9, 1, prefix=prefix, cache_dir=str(cache))
    assert len(list(cache.glob("*.deepyidx"))) == 4
    assert not list(cache.glob("*.tmp"))


@pytest.mark.parametrize("pack_impl", ["packed", "unpacked"])
def test_eras_permute_samples_only_within_each_era(pack_impl: str) -> None:
    """data_shuffle: L (Levanter's EraShufflingDataset, data/permutation.py:61-110@9263f81e): position i of an epoch
    reads a sample of its own era [(i // L) * L, (i // L + 1) * L) (the last era shorter), each era is a permutation of
    its samples, documents stay in file order, and every epoch repeats the order (Levanter's EpochDataset wraps the
    shuffled dataset). The reference is the file order itself (data_shuffle: false)."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 30, 400)
    era = 7
    plain = build_sample_index(sizes, 16, 1234, 1, pack_impl, shuffle=False)
    spe = len(plain["shuffle_idx"])
    eras = build_sample_index(sizes, 16, 1234, 3 * spe, pack_impl, shuffle=era)
    assert np.array_equal(eras["doc_idx"][: len(sizes)], np.arange(len(sizes)))  # documents in file order
    assert np.array_equal(eras["sample_idx"][:spe], plain["sample_idx"])  # the same samples, cut alike
    order = eras["shuffle_idx"][:spe]
    for start in range(0, spe, era):
        block = order[start : start + era]
        assert sorted(block.tolist()) == list(range(start, min(start + era, spe)))  # a permutation of its own era
    assert not np.array_equal(order, np.arange(spe))  # and not the file order
    assert np.array_equal(eras["shuffle_idx"][spe : 2 * spe] - spe, order)  # each epoch alike
    with_seed = build_sample_index(sizes, 16, 99, spe, pack_impl, shuffle=era)["shuffle_idx"][:spe]
    assert not np.array_equal(with_seed, order)  # the permutations follow the seed
