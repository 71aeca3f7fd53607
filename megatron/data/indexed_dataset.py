"""The MMIDIDX indexed dataset: token sequences in a flat ``.bin`` plus an ``.idx`` index.

This is the on-disk format GPT-NeoX and Megatron-LM write, so files are interchangeable with theirs.

``<prefix>.idx`` (all little endian)::

    magic     9 bytes   b"MMIDIDX\\x00\\x00"
    version   uint64    1
    dtype     uint8     code of the token dtype (see DTYPE_CODES)
    n         uint64    number of sequences
    m         uint64    len(doc_idx) = number of documents + 1
    sizes     int32[n]  tokens per sequence
    pointers  int64[n]  byte offset of each sequence in .bin
    doc_idx   int64[m]  0, then the sequence count at the end of every document

``<prefix>.bin`` is the sequences' tokens back to back, nothing else.

The reader maps both files (numpy memmap) so opening a dataset of any size is O(1) in memory; it checks
the header and the file sizes up front so a corrupt or truncated dataset fails at open with a
:class:`~megatron.errors.DataError` naming the file, not later with a garbage sample.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, overload

import numpy as np

from megatron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# The header is fixed-size: magic, version, dtype code, sequence count, doc_idx length.
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34 bytes

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}

# uint16 halves the size of .bin; the margin below 65,536 follows Megatron's convention.
UINT16_VOCAB_LIMIT = 65_500


def best_fitting_dtype(vocab_size: int | None) -> type[np.generic]:
    """uint16 when every token id fits (vocab < 65,500), else int32."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.uint16
    return np.int32


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    return f"{os.fspath(prefix)}.bin"


def dataset_exists(prefix: str | os.PathLike[str]) -> bool:
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


def dtype_code(dtype: Any) -> int:
    """The MMIDIDX code of a numpy dtype; DataError for one the format cannot store."""
    code = _CODE_OF.get(np.dtype(dtype))
    if code is None:
        raise DataError(f"dtype {np.dtype(dtype)} cannot be stored in an MMIDIDX dataset "
                        f"(allowed: {', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())})")
    return code


class _Index:
    """The parsed ``.idx``: sizes, pointers and doc_idx as read-only memmapped arrays."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            file_size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE)
        except FileNotFoundError:
            raise DataError(f"{path}: index file not found") from None
        except OSError as err:
            raise DataError(f"{path}: cannot read index file ({err.strerror})") from None
        if len(head) < HEADER_SIZE or head[:9] != MAGIC:
            raise DataError(f"{path}: not an MMIDIDX index file (bad magic {head[:9]!r}, "
                            f"expected {MAGIC!r})")
        _, version, code, n, m = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{path}: unsupported MMIDIDX version {version} (this reader knows {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} in header")
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * m
        if file_size != expected:
            raise DataError(f"{path}: index file is {file_size} bytes but its header "
                            f"({n} sequences, {m} doc_idx entries) needs {expected}; "
                            "the file is truncated or corrupt")
        self.dtype: type[np.generic] = DTYPE_CODES[code]
        self.itemsize = np.dtype(self.dtype).itemsize
        if file_size == HEADER_SIZE:
            self.sizes = np.zeros(0, np.int32)
            self.pointers = np.zeros(0, np.int64)
            self.doc_idx = np.zeros(0, np.int64)
        else:
            self._mmap = np.memmap(path, mode="r", dtype=np.uint8)
            buf = self._mmap
            self.sizes = np.frombuffer(buf, np.int32, count=n, offset=HEADER_SIZE)
            self.pointers = np.frombuffer(buf, np.int64, count=n, offset=HEADER_SIZE + 4 * n)
            self.doc_idx = np.frombuffer(buf, np.int64, count=m, offset=HEADER_SIZE + 12 * n)
        self._check_consistent()

    def _check_consistent(self) -> None:
        # Vectorised checks: cheap even for 10^8 sequences, and they catch an index written by a
        # buggy tool before it produces silently wrong samples.
        n = len(self.sizes)
        if n and (self.sizes.min() < 0):
            raise DataError(f"{self.path}: negative sequence size in index")
        if n:
            ends = self.pointers.astype(np.int64) + self.sizes.astype(np.int64) * self.itemsize
            if self.pointers[0] != 0 or not np.array_equal(self.pointers[1:], ends[:-1]):
                raise DataError(f"{self.path}: pointers do not match sizes (corrupt index)")
        if len(self.doc_idx):
            d = self.doc_idx
            if d[0] != 0 or d[-1] > n or (len(d) > 1 and np.any(d[1:] < d[:-1])):
                raise DataError(f"{self.path}: doc_idx is not a non-decreasing list from 0 to {n}")

    @property
    def data_bytes(self) -> int:
        """The exact size the ``.bin`` must have."""
        if not len(self.sizes):
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.itemsize


class MMapIndexedDataset:
    """Read-only view of an MMIDIDX dataset: ``ds[i]`` is sequence ``i`` as a numpy array.

    ``skip_warmup`` is accepted for GPT-NeoX call compatibility; the map is always lazy.
    """

    def __init__(self, prefix: str | os.PathLike[str], skip_warmup: bool = True) -> None:
        del skip_warmup
        self.prefix = os.fspath(prefix)
        self._index = _Index(index_file_path(self.prefix))
        bin_path = data_file_path(self.prefix)
        try:
            bin_size = os.path.getsize(bin_path)
        except FileNotFoundError:
            raise DataError(f"{bin_path}: data file not found (its index {self._index.path} exists)") from None
        expected = self._index.data_bytes
        if bin_size != expected:
            what = "truncated" if bin_size < expected else "longer than its index says"
            raise DataError(f"{bin_path}: data file is {bin_size} bytes but {self._index.path} "
                            f"describes {expected}; the .bin is {what} (.idx/.bin mismatch)")
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        self._bin: np.ndarray = (np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size
                                 else np.zeros(0, np.uint8))

    # Data-loader workers started with spawn receive a pickled dataset: send the prefix and map the
    # files again there, instead of copying every array through the pipe.
    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)  # type: ignore[misc]  # unpickling: the files are opened again

    # --- the index -------------------------------------------------------------------------
    @property
    def dtype(self) -> type[np.generic]:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """int32[n]: tokens in each sequence."""
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        """int64[n]: byte offset of each sequence in ``.bin``."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """int64[docs + 1]: sequence index where each document starts (and the end)."""
        return self._index.doc_idx

    def __len__(self) -> int:
        return len(self._index.sizes)

    @property
    def num_tokens(self) -> int:
        return int(self._index.sizes.sum(dtype=np.int64))

    # --- the tokens ------------------------------------------------------------------------
    def _sequence(self, i: int, offset: int, length: int) -> np.ndarray:
        ptr = int(self._index.pointers[i]) + offset * self._index.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=ptr)

    @overload
    def __getitem__(self, idx: int | np.integer) -> np.ndarray: ...

    @overload
    def __getitem__(self, idx: slice) -> list[np.ndarray]: ...

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        n = len(self)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            return [self.get(i) for i in range(start, stop, step)]
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {idx} out of range for a dataset of {n}")
        return self._sequence(i, 0, int(self._index.sizes[i]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if length is None)."""
        n = len(self)
        i = int(idx) + (n if int(idx) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"sequence {idx} out of range for a dataset of {n}")
        size = int(self._index.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size}")
        return self._sequence(i, offset, length)

    @staticmethod
    def exists(prefix: str | os.PathLike[str]) -> bool:
        return dataset_exists(prefix)


class MMapIndexedDatasetBuilder:
    """Streams sequences into ``bin_path``; :meth:`finalize` writes the index.

    Both files are written under temporary names and moved into place by ``finalize`` with
    ``os.replace``, so an interrupted run never leaves a half-written dataset that looks complete.
    """

    def __init__(self, bin_path: str | os.PathLike[str], dtype: Any = np.int64) -> None:
        self.bin_path = os.fspath(bin_path)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # fail now, not at finalize
        Path(self.bin_path).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = f"{self.bin_path}.tmp{os.getpid()}"
        self._file = open(self._tmp_bin, "wb")
        # Sizes arrive in chunks (one per add_documents call); concatenated once at finalize.
        self._sizes: list[np.ndarray] = []
        self._pending_sizes: list[int] = []
        self._doc_ends: list[np.ndarray] = []
        self._pending_doc_ends: list[int] = [0]
        self._count = 0  # sequences written so far

    # --- writing -----------------------------------------------------------------------------
    def add_item(self, tokens: Any) -> None:
        """Append one sequence (list, numpy array or torch tensor of token ids)."""
        if hasattr(tokens, "numpy"):  # torch tensor without importing torch here
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        self._file.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._pending_sizes.append(int(arr.size))
        self._count += 1

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._pending_doc_ends.append(self._count)

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append many one-sequence documents at once: ``tokens`` is their concatenation.

        The fast path for preprocessing: one write and no per-document Python work.
        """
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        sizes = np.asarray(sizes, dtype=np.int32)
        if int(sizes.sum(dtype=np.int64)) != tokens.size:
            raise ValueError(f"sizes sum to {int(sizes.sum())} but {tokens.size} tokens were given")
        self._flush_pending()
        self._file.write(tokens.data)
        self._sizes.append(sizes)
        self._doc_ends.append(self._count + np.arange(1, len(sizes) + 1, dtype=np.int64))
        self._count += len(sizes)

    def add_index(self, other_prefix: str | os.PathLike[str]) -> None:
        """Append every sequence and document of another dataset (same dtype), for merging."""
        other = MMapIndexedDataset(other_prefix)
        if np.dtype(other.dtype) != self.dtype:
            raise DataError(f"{index_file_path(other_prefix)}: token dtype {np.dtype(other.dtype)} "
                            f"differs from the merged dataset's {self.dtype}")
        self._flush_pending()
        with open(data_file_path(other_prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._file.write(chunk)
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        # Its doc_idx starts with 0 (already our current end), the rest shift by our count.
        self._doc_ends.append(np.array(other.doc_idx[1:], dtype=np.int64) + self._count)
        self._count += len(other)

    def _flush_pending(self) -> None:
        if self._pending_sizes:
            self._sizes.append(np.array(self._pending_sizes, dtype=np.int32))
            self._pending_sizes = []
        if self._pending_doc_ends:
            self._doc_ends.append(np.array(self._pending_doc_ends, dtype=np.int64))
            self._pending_doc_ends = []

    # --- closing -----------------------------------------------------------------------------
    def finalize(self, idx_path: str | os.PathLike[str]) -> None:
        """Write the index and move both files into place."""
        idx_path = os.fspath(idx_path)
        self._flush_pending()
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        doc_idx = np.concatenate(self._doc_ends) if self._doc_ends else np.zeros(1, np.int64)
        pointers = np.zeros(len(sizes), np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        tmp_idx = f"{idx_path}.tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
        # .bin first: a reader that sees the new .idx must also see the matching .bin.
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Drop a partial dataset (used when preprocessing fails half-way)."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)


def reference_logprobs_prefix(data_prefix: str, model_name: str) -> str:
    """`<prefix>_<model_name>`: GPT-NeoX's name for the reference log-probs of dataset `data_prefix`
    (written by ``generate.py`` precompute, read by DPO's ``reference_logps``)."""
    return f"{data_prefix}_{model_name}"
