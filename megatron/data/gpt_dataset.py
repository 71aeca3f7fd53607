"""GPT training samples read from MMIDIDX data through a cached sample index.

``GPTDataset`` serves one split (a contiguous range of documents) of one corpus. Sample ``i`` is a
dict of int64 arrays of ``seq_length + 1`` tokens: ``text``, plus ``label`` when an aligned label
dataset is given (SFT) or when the packing pads (so padding never gets loss).

Indices past ``len(ds)`` wrap by whole epochs of the built index, so a sampler that runs past the
planned number of samples keeps seeing complete epochs rather than failing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from megatron.data.index_cache import cache_key, dataset_content_key, default_cache_dir, load_or_build
from megatron.data.sample_index import (PACK_IMPLS, PackImpl, Shuffle, Span, build_sample_index, document_spans,
                                       packed_spans)
from megatron.errors import DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label value meaning "no loss here", as in GPT-NeoX and HF


class TokenSource(Protocol):
    """What a dataset needs from an indexed corpus (``MMapIndexedDataset`` or a test double)."""

    @property
    def sizes(self) -> np.ndarray: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def read_spans(source: TokenSource, spans: list[Span], doc_offset: int) -> np.ndarray:
    """Concatenate the spans (document ids relative to the split) as int64."""
    if not spans:
        return np.zeros(0, dtype=np.int64)
    parts = [np.asarray(source.get(doc + doc_offset, off, length)) for doc, off, length in spans]
    return np.concatenate(parts).astype(np.int64, copy=False)


def split_cache_path(
    prefix: str, cache_dir: str | None, name: str, params: Mapping[str, object]
) -> Path:
    """Where the index for ``prefix`` + ``params`` lives: keyed by the data's content, not its name."""
    key = cache_key(data=dataset_content_key(prefix), **params)
    return default_cache_dir(prefix, cache_dir) / f"{Path(prefix).name}_{name}_{key}.deepyidx"


class GPTDataset:
    """One split of one corpus as fixed-length samples, in the seeded global order."""

    wraps = True  # indices >= len(self) are valid (they wrap by epoch)

    def __init__(
        self,
        name: str,
        source: TokenSource,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        pack_impl: PackImpl = "packed",
        allow_chopped: bool = True,
        aligned: Mapping[str, TokenSource] | None = None,
        prefix: str | None = None,
        cache_dir: str | None = None,
        pad_id: int = 0,
        shuffle: Shuffle = True,
    ) -> None:
        """``shuffle``: ``data_shuffle`` (false: documents and samples in file order; an int: eras of samples)."""
        if pack_impl not in PACK_IMPLS:
            raise DataError(f"unknown pack_impl {pack_impl!r}; expected one of {', '.join(PACK_IMPLS)}")
        lo, hi = doc_range
        all_sizes = np.asarray(source.sizes)
        if not 0 <= lo < hi <= len(all_sizes):
            raise DataError(f"{name}: document range [{lo}, {hi}) is empty or outside the corpus of "
                            f"{len(all_sizes)} documents; check `split`")
        self.aligned = dict(aligned or {})
        for key, other in self.aligned.items():
            if not np.array_equal(np.asarray(other.sizes), all_sizes):
                raise DataError(f"{name}: the {key!r} dataset is not aligned with the text dataset "
                                "(different document lengths); re-run the preprocessing tool")
        self.name, self.source, self.lo, self.hi = name, source, lo, hi
        self.seq_length, self.pack_impl, self.pad_id = seq_length, pack_impl, pad_id
        self.num_samples = int(num_samples)
        self.sizes = all_sizes[lo:hi]

        def build() -> dict[str, np.ndarray]:
            try:
                return build_sample_index(self.sizes, seq_length, seed, self.num_samples, pack_impl, allow_chopped,
                                          shuffle)
            except DataError as err:  # say which split of which corpus, not only what is wrong
                raise DataError(f"{name} split of {prefix or 'the corpus'} (documents [{lo}, {hi})): {err}") from None

        if prefix is None:
            arrays = build()
        else:
            params = {"docs": [lo, hi], "seq_length": seq_length, "seed": seed, "num_samples": self.num_samples,
                      "pack_impl": pack_impl, "allow_chopped": allow_chopped}
            if shuffle is not True:  # keyed only when not the default: the shuffled indexes cached keep their names
                params["shuffle"] = shuffle
            path = split_cache_path(prefix, cache_dir, name, params)
            arrays = load_or_build(path, build)
            logger.info("%s: sample index %s (%d samples)", name, path, len(arrays["shuffle_idx"]))
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self._spans = packed_spans if pack_impl == "packed" else document_spans

    def __len__(self) -> int:
        return self.num_samples

    def spans(self, i: int) -> list[Span]:
        """Document pieces (split-relative ids) of global sample ``i``."""
        if i < 0:
            raise IndexError(f"negative sample index {i}")
        row = int(self.shuffle_idx[i % len(self.shuffle_idx)])
        return self._spans(self.doc_idx, self.sample_idx, self.sizes, row, self.seq_length)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        spans = self.spans(int(i))
        length = self.seq_length + 1
        text = read_spans(self.source, spans, self.lo)
        out = {"text": _pad(text, length, self.pad_id)}
        for key, other in self.aligned.items():
            out[key] = _pad(read_spans(other, spans, self.lo), length, IGNORE_INDEX)
        if self.pack_impl != "packed" and "label" not in out:
            # Padding must not be learned: these packings give every sample a label (-100 on
            # padding), so all samples of a batch carry the same keys.
            out["label"] = _pad(text.copy(), length, IGNORE_INDEX)
        return out


def _pad(x: np.ndarray, length: int, value: int) -> np.ndarray:
    if len(x) >= length:
        return x[:length]
    return np.concatenate([x, np.full(length - len(x), value, dtype=np.int64)])
