"""Token ids the model has no row for: refused by name instead of crashing a rank.

Data tokenized with another tokenizer holds ids at or beyond this run's vocabulary. The embedding lookup of
such an id raised an ``IndexError`` traceback on rank 0 (one tensor-parallel rank), or - split over tensor
parallelism, where every rank masks the ids outside its slice - silently read a zero embedding and a zero
target logit. Two checks name the file instead:

* before launch, :func:`largest_token` reads the datasets the config names on this machine (a numpy
  maximum over the memory-mapped ``.bin``, up to :data:`SCAN_BUDGET_BYTES` in all) and
  ``megatron/neox_arguments/file_checks.py`` refuses ids at or beyond the tokenizer's vocabulary;
* on the ranks, :class:`TokenRangeChecked` looks at every sample as it is read (one maximum per sample)
  and refuses ids at or beyond the embedding's rows, naming the files of the component it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path
from megatron.errors import DataError

SCAN_BUDGET_BYTES = 2 << 30
"""Token data read before launch, in all; larger datasets are left to the ranks' check."""


@dataclass(frozen=True)
class LargestToken:
    value: int
    sequence: int
    """Index of the first sequence holding it."""


def largest_token(prefix: str) -> LargestToken | None:
    """The largest id in dataset ``prefix`` (None when it is empty) and the first sequence holding it."""
    dataset = MMapIndexedDataset(prefix)
    tokens = np.memmap(data_file_path(prefix), dtype=dataset.dtype, mode="r")
    if tokens.size == 0:
        return None
    position = int(np.argmax(tokens))
    ends = np.cumsum(dataset.sizes, dtype=np.int64)
    return LargestToken(int(tokens[position]), int(np.searchsorted(ends, position, side="right")))


def cannot_exceed(prefix: str, bound: int) -> bool:
    """Whether the dataset's integer type cannot hold an id ``>= bound`` (nothing to read)."""
    dtype = np.dtype(MMapIndexedDataset(prefix).dtype)
    return np.issubdtype(dtype, np.integer) and int(np.iinfo(dtype).max) < bound


class TokenRangeChecked:
    """``dataset`` whose samples are refused when one of their token arrays holds an id ``>= rows`` (the
    embedding's rows); every other attribute is the dataset's own."""

    def __init__(self, dataset: Any, rows: int, files: Mapping[str, str]) -> None:
        self.dataset, self.rows, self.files = dataset, int(rows), dict(files)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = self.dataset[index]
        for key, values in sample.items():
            array = np.asarray(values)
            if array.size and np.issubdtype(array.dtype, np.integer) and int(array.max()) >= self.rows:
                files = ", ".join(f"{role} {prefix}" for role, prefix in self.files.items())
                raise DataError(f"sample {index} ({key}) of {files} holds token id {int(array.max())}, but the model's "
                                f"embedding has {self.rows} rows (the tokenizer's vocabulary, padded): the data was "
                                "tokenized with another tokenizer; rebuild it with this run's tokenizer_type and "
                                "vocab_file, or train with the tokenizer it was built with")
        return sample
