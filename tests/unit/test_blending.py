"""Blending: proportions in every prefix, determinism, speed, NeoX document-count weighting."""

from __future__ import annotations

import time

import numpy as np
import pytest

from megatron.data.blendable_dataset import (
    BlendedDataset,
    blend_index,
    samples_per_dataset,
    weights_by_num_documents,
)
from megatron.errors import DataError


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
    with pytest.raises(DataError):
        weights_by_num_documents([0, 4], 0.3)


def test_bad_weights() -> None:
    for bad in ([], [0, 0], [-1, 2], [float("nan")]):
        with pytest.raises(DataError):
            blend_index(bad, 10)
