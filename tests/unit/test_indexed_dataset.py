"""MMIDIDX reader/writer: exact bytes, round trips, merging, and every corrupt-file error."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    dataset_exists,
)
from megatron.errors import DataError

# Written out here, independently of the module under test.
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def expected_files(seqs: list[list[int]], doc_idx: list[int], dtype: type) -> tuple[bytes, bytes]:
    """The .bin and .idx bytes for these sequences, built with struct and numpy only."""
    item = np.dtype(dtype).itemsize
    binary = b"".join(np.asarray(s, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes() for s in seqs)
    sizes = [len(s) for s in seqs]
    pointers, offset = [], 0
    for n in sizes:
        pointers.append(offset)
        offset += n * item
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
    idx += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return binary, idx


def write(prefix: Path, docs: list[list[list[int]]], dtype: type = np.uint16) -> None:
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(f"{prefix}.idx")


DOCS = [[[1, 2, 3], [4]], [[5, 6]], [[7], [8, 9, 10, 11], [12]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_builder_writes_exact_mmidx_bytes(tmp_path: Path, dtype: type) -> None:
    write(tmp_path / "d", DOCS, dtype)
    seqs = [s for doc in DOCS for s in doc]
    binary, idx = expected_files(seqs, [0, 2, 3, 6], dtype)
    assert (tmp_path / "d.bin").read_bytes() == binary
    assert (tmp_path / "d.idx").read_bytes() == idx


def test_reader_round_trip(tmp_path: Path) -> None:
    write(tmp_path / "d", DOCS)
    ds = MMapIndexedDataset(tmp_path / "d")
    seqs = [s for doc in DOCS for s in doc]
    assert len(ds) == len(seqs)
    assert ds.dtype == np.uint16
    assert list(ds.sizes) == [len(s) for s in seqs]
    assert list(ds.pointers) == [0, 6, 8, 12, 14, 22]
    assert list(ds.doc_idx) == [0, 2, 3, 6]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds[-1].tolist() == [12]
    assert [a.tolist() for a in ds[1:3]] == [[4], [5, 6]]
    assert ds.get(4).tolist() == [8, 9, 10, 11]
    assert ds.get(4, offset=1).tolist() == [9, 10, 11]
    assert ds.get(4, offset=1, length=2).tolist() == [9, 10]
    assert ds.num_tokens == 12
    with pytest.raises(IndexError):
        ds[6]
    with pytest.raises(IndexError):
        ds.get(4, offset=3, length=2)
    assert dataset_exists(tmp_path / "d") and not dataset_exists(tmp_path / "e")


def test_pickles_by_prefix(tmp_path: Path) -> None:
    import pickle

    write(tmp_path / "d", DOCS)
    ds = MMapIndexedDataset(tmp_path / "d")
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # the prefix, not the arrays
    again = pickle.loads(blob)
    assert [again[i].tolist() for i in range(len(again))] == [ds[i].tolist() for i in range(len(ds))]


def test_add_documents_equals_add_item(tmp_path: Path) -> None:
    docs = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    write(tmp_path / "a", [[d] for d in docs])
    b = MMapIndexedDatasetBuilder(tmp_path / "b.bin", np.uint16)
    b.add_documents(np.array(docs[0] + docs[1]), np.array([3, 2]))
    b.add_documents(np.array(docs[2]), np.array([4]))
    b.finalize(tmp_path / "b.idx")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def test_add_index_merges_documents(tmp_path: Path) -> None:
    write(tmp_path / "x", DOCS[:2])
    write(tmp_path / "y", DOCS[2:])
    b = MMapIndexedDatasetBuilder(tmp_path / "m.bin", np.uint16)
    b.add_index(tmp_path / "x")
    b.add_index(tmp_path / "y")
    b.finalize(tmp_path / "m.idx")
    write(tmp_path / "all", DOCS)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"all{suffix}").read_bytes()


def test_add_index_rejects_other_dtype(tmp_path: Path) -> None:
    write(tmp_path / "x", DOCS, np.int32)
    b = MMapIndexedDatasetBuilder(tmp_path / "m.bin", np.uint16)
    with pytest.raises(DataError, match="dtype"):
        b.add_index(tmp_path / "x")
    b.abort()


def test_files_appear_only_at_finalize(tmp_path: Path) -> None:
    b = MMapIndexedDatasetBuilder(tmp_path / "d.bin", np.uint16)
    b.add_item([1, 2])
    b.end_document()
    assert not (tmp_path / "d.bin").exists()
    b.abort()
    assert os.listdir(tmp_path) == []


def test_empty_dataset_round_trips(tmp_path: Path) -> None:
    b = MMapIndexedDatasetBuilder(tmp_path / "e.bin", np.uint16)
    b.finalize(tmp_path / "e.idx")
    ds = MMapIndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and list(ds.doc_idx) == [0]


def test_best_fitting_dtype() -> None:
    assert best_fitting_dtype(50_257) == np.uint16
    assert best_fitting_dtype(65_499) == np.uint16
    assert best_fitting_dtype(65_500) == np.int32
    assert best_fitting_dtype(100_277) == np.int32


# --- corrupt files --------------------------------------------------------------------------
@pytest.fixture
def good(tmp_path: Path) -> Path:
    write(tmp_path / "d", DOCS)
    return tmp_path / "d"


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_bad_magic(good: Path) -> None:
    _patch(good.with_suffix(".idx"), 0, b"NOTMMIDX!")
    with pytest.raises(DataError, match=r"d\.idx.*magic"):
        MMapIndexedDataset(good)


def test_wrong_version(good: Path) -> None:
    _patch(good.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"d\.idx.*version 2"):
        MMapIndexedDataset(good)


def test_unknown_dtype_code(good: Path) -> None:
    _patch(good.with_suffix(".idx"), 17, b"\x09")
    with pytest.raises(DataError, match=r"d\.idx.*dtype code 9"):
        MMapIndexedDataset(good)


def test_truncated_index(good: Path) -> None:
    idx = good.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"d\.idx.*truncated"):
        MMapIndexedDataset(good)


def test_truncated_bin(good: Path) -> None:
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"d\.bin.*truncated"):
        MMapIndexedDataset(good)


def test_bin_longer_than_index(good: Path) -> None:
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes() + b"\x00\x00")
    with pytest.raises(DataError, match=r"d\.bin.*mismatch"):
        MMapIndexedDataset(good)


def test_corrupt_pointers(good: Path) -> None:
    n = 6
    _patch(good.with_suffix(".idx"), 34 + 4 * n + 8, struct.pack("<q", 7))
    with pytest.raises(DataError, match=r"d\.idx.*pointers"):
        MMapIndexedDataset(good)


def test_missing_files(good: Path) -> None:
    good.with_suffix(".bin").unlink()
    with pytest.raises(DataError, match=r"d\.bin.*not found"):
        MMapIndexedDataset(good)
    good.with_suffix(".idx").unlink()
    with pytest.raises(DataError, match=r"d\.idx.*not found"):
        MMapIndexedDataset(good)
