"""Blending: proportions in every prefix, determinism, speed, NeoX document-count weighting."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from megatron.data.blendable_dataset import (
    BlendedDataset,
    blend_index,
    samples_per_dataset,
    weights_by_num_documents,
)
from megatron.data.build import DataSplits, build_datasets, parse_split, samples_needed, split_ranges
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.run_config import data_run
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.errors import ConfigError, DataError


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [1, 3, 0, 6], [0.013, 0.987]])
def test_proportions_within_one_percent(weights: list[float]) -> None:
    w = np.asarray(weights, dtype=float) / sum(weights)
    d, k = blend_index(weights, 20_000)
    counts = samples_per_dataset(d, len(w))
    assert np.all(np.abs(counts / 20_000 - w) < 0.01)
    # The greedy schedule is close in every prefix, not only at the end.
    onehot = np.zeros((len(d), len(w)))
    onehot[np.arange(len(d)), d] = 1
    prefix_counts = np.cumsum(onehot, axis=0)
    n = np.arange(1, len(d) + 1)[:, None]
    assert np.abs(prefix_counts - n * w).max() < len(w)
    # Within a dataset, samples are taken in order 0, 1, 2, ... with none skipped or repeated.
    for j in range(len(w)):
        assert np.array_equal(k[d == j], np.arange(counts[j]))


def test_ten_million_samples_quickly() -> None:
    t0 = time.perf_counter()
    d, k = blend_index([0.3, 0.25, 0.25, 0.2], 10_000_000)
    elapsed = time.perf_counter() - t0
    assert len(d) == 10_000_000
    assert np.all(np.abs(np.bincount(d) / 1e7 - [0.3, 0.25, 0.25, 0.2]) < 1e-4)
    assert elapsed < 20, f"blend index of 1e7 samples took {elapsed:.1f}s"


def test_deterministic_and_dataset_lookup() -> None:
    a = blend_index([2, 1], 999)
    b = blend_index([2, 1], 999)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    ds = BlendedDataset([[{"text": np.array([0, i])} for i in range(700)],
                         [{"text": np.array([1, i])} for i in range(400)]], [2, 1], 999)
    assert len(ds) == 999
    got = [tuple(ds[i]["text"]) for i in range(999)]
    assert sum(1 for g in got if g[0] == 0) == 666
    assert got[999 - 1] == tuple(ds[2 * 999 - 1]["text"])  # wraps past the end


def test_weights_by_num_documents_flattens() -> None:
    w = weights_by_num_documents([1000, 100, 10], alpha=0.3)
    natural = np.array([1000, 100, 10]) / 1110
    assert w.sum() == pytest.approx(1.0)
    assert w[2] > natural[2] and w[0] < natural[0]  # small corpora up-sampled
    assert list(weights_by_num_documents([5], 0.3)) == [1.0]
    # NeoX's extra (1 - q) factor: at alpha = 1, two corpora end up equally weighted.
    assert weights_by_num_documents([900, 100], 1.0) == pytest.approx([0.5, 0.5])
    # alpha = 0 (uniform tempering): w ~ (1 - q)
    assert weights_by_num_documents([3, 1], 0.0) == pytest.approx([0.25, 0.75])
    with pytest.raises(DataError):
        weights_by_num_documents([0, 4], 0.3)


def test_bad_weights() -> None:
    for bad in ([], [0, 0], [-1, 2], [float("nan")]):
        with pytest.raises(DataError):
            blend_index(bad, 10)


# ---- splits and blends from the config (build.py) ----------------------------------------------


def test_split_ranges_cover_documents() -> None:
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("969, 30, 1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert list(parse_split("2/1/1")) == [0.5, 0.25, 0.25]
    for bad in ("a,b", "1,-1,0", "0,0", "1,1,1,1"):
        with pytest.raises(ConfigError):
            parse_split(bad)


def test_samples_needed_from_schedule() -> None:
    assert samples_needed(8, 100, eval_iters=5, eval_interval=30) == (800, (100 // 30 + 1) * 5 * 8, 40)
    assert samples_needed(8, 100, eval_iters=0, eval_interval=1000) == (800, 0, 0)


def _corpus(path: Path, marker: int, docs: int) -> str:
    prefix = str(path / f"c{marker}_text_document")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for i in range(docs):
        b.add_item(np.full(5 + i % 4, marker))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def build(padded_vocab_size: int = 64, **kw: object) -> DataSplits:
    base: dict[str, object] = dict(seq_length=8, seed=1, train_batch_size=10, train_iters=100, eval_iters=0,
                                   eval_interval=10)
    base.update(kw)
    return build_datasets(data_run(NeoXArgs(**base)), None, padded_vocab_size)


def test_build_blend_from_train_paths(tmp_path: Path) -> None:
    a, b = _corpus(tmp_path, 1, 50), _corpus(tmp_path, 2, 400)
    splits = build(train_data_paths=[a, b], train_data_weights=[3, 1])
    markers = np.array([splits.train[i]["text"][0] for i in range(1000)])
    assert abs(np.mean(markers == 1) - 0.75) < 0.01
    assert splits.valid is None and splits.test is None
    # weight_by_num_documents: alpha < 1 up-samples the small corpus above its natural 1/9 share.
    splits = build(train_data_paths=[a, b], weight_by_num_documents=True, weighted_sampler_alpha=0.3)
    share = np.mean([splits.train[i]["text"][0] == 1 for i in range(1000)])
    assert share > 50 / 450 + 0.05
    assert list((tmp_path / "index-cache").glob("*.deepyidx"))  # indices cached next to the data
    with pytest.raises(ConfigError):
        build(train_data_paths=[a, b], train_data_weights=[1])


def test_build_data_path_split_and_dummy(tmp_path: Path) -> None:
    a = _corpus(tmp_path, 3, 100)
    splits = build(data_path=a, split="80,10,10", eval_iters=2, cache_dir=str(tmp_path / "c"))
    assert (splits.train.lo, splits.train.hi) == (0, 80)
    assert (splits.valid.lo, splits.valid.hi) == (80, 90) and (splits.test.lo, splits.test.hi) == (90, 100)
    assert len(splits.train) == 1000 and len(splits.valid) == (100 // 10 + 1) * 2 * 10
    dummy = build(use_dummy_dataset=True, padded_vocab_size=64, eval_iters=1)
    assert len(dummy.train) == 1000 and dummy.train[5]["text"].shape == (9,)
    assert not np.array_equal(dummy.train[5]["text"], dummy.valid[5]["text"])
    with pytest.raises(ConfigError, match="prepare_data.py"):
        build()


def test_train_epochs_sets_train_samples(tmp_path: Path) -> None:
    a = _corpus(tmp_path, 4, 100)  # 650 tokens -> 81 samples of 8+1 per epoch
    splits = build(train_data_paths=[a], train_iters=None, train_epochs=3)
    assert len(splits.train) == (3 * 81) // 10 * 10


@pytest.mark.parametrize("split", ["valid", "test"])
def test_evaluation_splits_blend_by_their_own_weights(tmp_path: Path, split: str) -> None:
    """valid_data_weights / test_data_weights weigh the evaluation blends as train_data_weights does."""
    a, b = _corpus(tmp_path, 1, 50), _corpus(tmp_path, 2, 400)
    splits = build(train_data_paths=[a], eval_iters=100, **{f"{split}_data_paths": [a, b],
                                                             f"{split}_data_weights": [3, 1]})
    dataset = getattr(splits, split)
    markers = np.array([dataset[i]["text"][0] for i in range(len(dataset))])
    assert abs(np.mean(markers == 1) - 0.75) < 0.02
