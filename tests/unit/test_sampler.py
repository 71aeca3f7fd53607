"""Sampler: layout-independent global order, O(1) resume; the batch arithmetic it reads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from megatron.data.dummy_dataset import DummyDataset
from megatron.data.batch import BatchError, BatchLayout, solve_batch
from megatron.data.sampler import MicroBatchIterator, micro_batch_indices
from megatron.errors import DataError


class IndexDataset:
    """Sample i is [i, i, ...]: makes the global index visible in the batch."""

    def __init__(self, n: int, seq: int = 4) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        assert 0 <= i < self.n
        return {"text": np.full(self.seq + 1, i, dtype=np.int64), "reward": np.float32(i / 2)}


def layout(G: int, mbs: int, dp: int = 1) -> BatchLayout:
    """The layout of a global batch of G samples (what deepy.py solves before launch)."""
    return solve_batch(mbs, None, G, dp)


def _global_order(dataset, dp: int, mbs: int, G: int, batches: int, consumed: int = 0) -> list[int]:
    """Reassemble the global sample sequence from all dp ranks' micro-batches."""
    its = [MicroBatchIterator(dataset, consumed, layout(G, mbs, dp), r) for r in range(dp)]
    gas = G // (mbs * dp)
    order: list[int] = []
    for _ in range(batches):
        for it in its:  # rank r's slice comes after rank r-1's
            for _ in range(gas):
                order.extend(next(it)["text"][:, 0].tolist())
    return order


def test_global_order_same_for_any_dp_and_micro_batch() -> None:
    ds = IndexDataset(1000)
    ref = _global_order(ds, dp=1, mbs=8, G=8, batches=10)
    assert ref == list(range(80))
    for dp, mbs in [(2, 1), (2, 4), (4, 2), (4, 1), (1, 2)]:
        assert _global_order(ds, dp, mbs, 8, 10) == ref


def test_dummy_samples_identical_across_dp() -> None:
    ds = DummyDataset(10_000, 16, 50, seed=3)
    one = MicroBatchIterator(ds, 0, layout(4, 4), 0)
    two = [MicroBatchIterator(ds, 0, layout(4, 1, 2), r) for r in range(2)]
    for _ in range(3):
        full = next(one)["text"]
        parts = [torch.cat([next(it)["text"], next(it)["text"]]) for it in two]
        assert torch.equal(full, torch.cat(parts))
        assert full.dtype == torch.int64 and full.shape == (4, 17)


def test_change_dp_on_resume_keeps_order() -> None:
    ds = IndexDataset(1000)
    before = _global_order(ds, dp=2, mbs=2, G=8, batches=3)
    after = _global_order(ds, dp=4, mbs=1, G=8, batches=3, consumed=24)
    assert before + after == list(range(48))


def test_resume_is_constant_time() -> None:
    ds = DummyDataset(10**12, 32, 1000)

    def first_batch_time(consumed: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            it = MicroBatchIterator(ds, consumed, layout(10, 5, 2), 1)  # G=10: dp=2 ranks x 5 samples
            next(it)
            best = min(best, time.perf_counter() - t0)
        return best

    small, large = first_batch_time(10), first_batch_time(10**8)
    assert large / small < 5 or large < 0.05, (small, large)
    it = MicroBatchIterator(ds, 10**8, layout(10, 5, 2), 1)
    assert it.indices().tolist() == [10**8 + 5 + i for i in range(5)]
    assert torch.equal(next(it)["text"][0], torch.from_numpy(ds[10**8 + 5]["text"]))


def test_wraps_and_collates_floats() -> None:
    ds = IndexDataset(10)
    it = MicroBatchIterator(ds, 8, layout(4, 4))
    b = next(it)
    assert b["text"][:, 0].tolist() == [8, 9, 0, 1]
    assert b["reward"].dtype == torch.float32 and b["reward"].tolist() == [4.0, 4.5, 0.0, 0.5]
    assert it.consumed_samples == 12


def test_batch_arithmetic() -> None:
    """GPT-NeoX's rule, train_batch_size = micro x gas x dp (any two give the third), computed by hand."""
    assert solve_batch(2, None, 12, 3) == BatchLayout(micro=2, gas=2, dp=3)  # micro + global -> gas
    assert solve_batch(None, 2, 12, 3) == BatchLayout(micro=2, gas=2, dp=3)  # gas + global -> micro
    assert solve_batch(2, 2, None, 3).global_size == 12  # micro + gas -> global
    assert solve_batch(2, None, None, 3) == BatchLayout(micro=2, gas=1, dp=3)
    assert solve_batch(None, None, 12, 3) == BatchLayout(micro=4, gas=1, dp=3)
    assert BatchLayout(micro=2, gas=2, dp=3).keys() == {
        "train_micro_batch_size_per_gpu": 2, "batch_size": 2, "gradient_accumulation_steps": 2, "train_batch_size": 12}
    bad = ((4, None, 10, 1), (2, 2, 10, 2), (None, 3, 8, 1), (None, None, 9, 2), (None, 2, None, 1))
    for micro, gas, total, dp in bad:
        with pytest.raises(BatchError):
            solve_batch(micro, gas, total, dp)


def test_sampler_reads_the_layout() -> None:
    with pytest.raises(DataError):
        MicroBatchIterator(IndexDataset(10), 3, layout(4, 2))  # not a whole number of global batches
    with pytest.raises(ValueError):
        MicroBatchIterator(IndexDataset(10), 0, layout(8, 2, 2), 2)  # no rank 2 of 2
    batch = layout(12, 2, 3)
    assert micro_batch_indices(batch, 1, 2, 1).tolist() == [24 + 4 + 2, 24 + 4 + 3]
    it = MicroBatchIterator(IndexDataset(100), 12, batch, 1)
    seen = [next(it)["text"][:, 0].tolist() for _ in range(batch.gas + 1)]
    assert seen == [[16, 17], [18, 19], [28, 29]]  # rank 1's 4 samples of batch 1, then of batch 2


def test_dummy_determinism() -> None:
    a, b = DummyDataset(100, 8, 30, seed=1), DummyDataset(5, 8, 30, seed=1)
    assert np.array_equal(a[3]["text"], b[3]["text"])
    assert not np.array_equal(a[3]["text"], a[4]["text"])
    assert not np.array_equal(a[3]["text"], DummyDataset(100, 8, 30, seed=2)[3]["text"])
    assert a[7]["text"].max() < 30 and a[7]["text"].shape == (9,)


def test_real_blend_same_samples_for_dp_1_2_4(tmp_path) -> None:
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefixes = []
    for marker in (1, 2):
        prefix = str(tmp_path / f"c{marker}")
        b = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for i in range(60):
            b.add_item(np.arange(i, i + 3 + i % 5) % 97 + marker * 100)
            b.end_document()
        b.finalize(prefix + ".idx")
        prefixes.append(prefix)
    config = NeoXArgs(seq_length=6, seed=9, train_batch_size=8, train_iters=12, eval_iters=0, eval_interval=4,
                           train_data_paths=prefixes, train_data_weights=[0.6, 0.4], cache_dir=str(tmp_path / "c"))
    train = build_datasets(data_run(config), None, 512).train

    def run(dp: int, mbs: int) -> torch.Tensor:
        its = [MicroBatchIterator(train, 16, layout(8, mbs, dp), r) for r in range(dp)]
        rows = []
        for _ in range(4):  # global batches 2..5
            for it in its:
                for _ in range(8 // (mbs * dp)):
                    rows.append(next(it)["text"])
        return torch.cat(rows)

    ref = run(1, 8)
    assert ref.shape == (32, 7)
    assert torch.equal(ref[0], torch.from_numpy(train[16]["text"]))
    for dp, mbs in ((2, 2), (4, 1), (4, 2)):
        assert torch.equal(run(dp, mbs), ref)


# --- background prefetching --------------------------------------------------------------------
def test_prefetcher_yields_exactly_the_source_in_order() -> None:
    from megatron.data.sampler import Prefetcher, prefetched

    batches = [{"text": torch.full((2, 3), i)} for i in range(7)]
    got = list(Prefetcher(iter(batches), depth=2))
    assert len(got) == 7 and all(torch.equal(g["text"], b["text"]) for g, b in zip(got, batches))
    source = iter(batches)
    assert prefetched(source, 0) is source  # num_workers 0: read on demand, no thread


def test_prefetcher_raises_the_source_error_where_the_batch_was_due() -> None:
    from megatron.data.sampler import Prefetcher

    def source():
        yield {"text": torch.zeros(1, 2)}
        raise DataError("bad sample 1")

    it = Prefetcher(source(), depth=3)
    assert torch.equal(next(it)["text"], torch.zeros(1, 2))
    with pytest.raises(DataError, match="bad sample 1"):
        next(it)
    with pytest.raises(DataError):  # and stays failed
        next(it)


def test_prefetcher_reads_ahead_while_the_consumer_is_busy() -> None:
    import threading

    from megatron.data.sampler import Prefetcher

    read = []
    two_read = threading.Event()

    def source():
        for i in range(5):
            read.append(i)
            if len(read) == 2:
                two_read.set()
            yield {"text": torch.tensor([i])}

    it = Prefetcher(source(), depth=2)
    assert two_read.wait(timeout=10), "nothing was read ahead before the first next()"
    assert [int(next(it)["text"]) for _ in range(5)] == [0, 1, 2, 3, 4]



def test_the_batch_arithmetic_is_solved_and_checked_in_one_place() -> None:
    """Issue 20 (no invariant checked twice): ``train_batch_size = micro x gas x dp`` is computed and
    checked by ``solve_batch`` alone; the rule before launch calls it, the sampler only reads the layout."""
    import inspect

    from megatron.data import sampler
    from megatron.neox_arguments.derived import derive_batch

    rule = inspect.getsource(derive_batch)
    assert "solve_batch(" in rule and "%" not in rule and "//" not in rule
    source = inspect.getsource(sampler)
    assert "ConfigError" not in source and "solve_batch" not in source and "//" not in source.replace(
        "consumed_samples // global_size", "")  # the position in whole global batches, not the arithmetic
    assert BatchLayout(micro=3, gas=5, dp=7).global_size == 105  # the product, so the three cannot disagree
