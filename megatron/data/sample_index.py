"""Index math for GPT training samples: pure numpy functions of (document sizes, seq_length, seed).

A *sample* is ``seq_length + 1`` tokens: the model reads the first ``seq_length`` and predicts the last
``seq_length``, so consecutive packed samples share one boundary token (sample ``j`` covers stream
positions ``[j*L, j*L + L + 1)``), as in GPT-NeoX and Megatron.

Every epoch is built independently from ``(seed, epoch)``: the document order is a fresh permutation,
documents are concatenated into one token stream and cut into samples, and the samples of the epoch
are shuffled. Because no epoch depends on how many epochs exist, global sample ``i`` is the same
whatever ``num_samples`` was requested: the global sample order is a pure function of
(data, seed, seq_length), and asking for more samples only appends epochs.

Three packings, after GPT-NeoX's ``pack_impl``:

- ``packed``: the stream is cut every ``L`` tokens; documents straddle samples. The last
  ``(T - 1) % L`` tokens of each epoch are the only ones not seen in that epoch.
- ``pack_until_overflow``: whole documents are added to a sample until the next one would overflow it;
  the rest is padding. A document longer than ``L + 1`` is truncated into its own sample if
  ``allow_chopped``, else dropped.
- ``unpacked``: one document per sample, padded to ``L + 1``; a longer one is truncated if
  ``allow_chopped``, else dropped.

Arrays (all int64 unless noted):

- ``doc_idx``: ``[E * n]`` document ids, epoch after epoch.
- ``sample_idx``: ``[S, 2]``. ``packed``: (position in ``doc_idx``, token offset) of the sample start.
  ``pack_until_overflow``/``unpacked``: the half-open range of ``doc_idx`` positions in the sample.
- ``shuffle_idx``: ``[S]`` global sample ``i`` reads row ``shuffle_idx[i]`` of ``sample_idx``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from megatron.errors import DataError

PackImpl = Literal["packed", "pack_until_overflow", "unpacked"]
PACK_IMPLS: tuple[str, ...] = ("packed", "pack_until_overflow", "unpacked")

# Salts keep the document shuffle and the sample shuffle of one epoch independent streams.
_DOC_SALT = 0
_SAMPLE_SALT = 1


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(epoch), salt])


Shuffle = bool | int
"""``data_shuffle``: true (a seeded permutation per epoch), false (file order) or an era length ``L`` (samples permuted
within consecutive eras of ``L``, documents in file order: Levanter's ``shuffle: L``)."""
_ERA_SALT = 2


def _order(n: int, seed: int, epoch: int, salt: int, shuffle: Shuffle) -> np.ndarray:
    """A seeded permutation of ``range(n)`` for ``(epoch, salt)``; without ``shuffle`` (``data_shuffle: false``)
    the identity: documents and samples in file order; with an era length, the identity for the documents and
    :func:`era_order` for the samples."""
    if shuffle is True:
        return _rng(seed, epoch, salt).permutation(n)
    if shuffle is False or salt == _DOC_SALT:
        return np.arange(n, dtype=np.int64)
    return era_order(n, int(shuffle), seed)


def era_order(n: int, era: int, seed: int) -> np.ndarray:
    """Levanter's ``EraShufflingDataset`` (``data/permutation.py:61-110``@9263f81e): position ``i`` reads
    ``pi(i) in [(i // L) * L, (i // L + 1) * L)``, a seeded permutation of each era (the last one shorter), the same
    in every epoch (Levanter's ``EpochDataset`` wraps the shuffled dataset). numpy's generator, not jax's
    ``fold_in``/Feistel permutation: the eras are Levanter's, the order inside one is not."""
    out = np.arange(n, dtype=np.int64)
    for start in range(0, n, era):
        stop = min(start + era, n)
        out[start:stop] = start + _rng(seed, start // era, _ERA_SALT).permutation(stop - start)
    return out


def packed_samples_per_epoch(total_tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length + 1`` tokens (sharing boundaries) that fit in one epoch's stream."""
    return max(0, (int(total_tokens) - 1) // int(seq_length))


def epochs_needed(samples_per_epoch: int, num_samples: int) -> int:
    """Smallest number of epochs whose samples cover ``num_samples`` (at least one)."""
    if samples_per_epoch <= 0:
        raise DataError("the dataset yields no samples: it has fewer tokens than seq_length + 1")
    return max(1, -(-int(num_samples) // samples_per_epoch))


def _check(sizes: np.ndarray, seq_length: int) -> np.ndarray:
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.ndim != 1 or sizes.size == 0:
        raise DataError("the dataset (or this split of it) has no documents")
    if seq_length <= 0:
        raise DataError(f"seq_length must be positive, got {seq_length}")
    return sizes


def build_packed_index(sizes: np.ndarray, seq_length: int, seed: int, num_samples: int,
                       shuffle: Shuffle = True) -> dict[str, np.ndarray]:
    """``packed`` index covering at least ``num_samples`` samples (vectorised per epoch); ``shuffle`` false:
    no permutation of the documents or the samples."""
    sizes = _check(sizes, seq_length)
    n = sizes.size
    spe = packed_samples_per_epoch(int(sizes.sum()), seq_length)
    num_epochs = epochs_needed(spe, num_samples)
    starts = np.arange(spe, dtype=np.int64) * seq_length  # sample starts in the epoch's stream
    doc_idx = np.empty(num_epochs * n, dtype=np.int64)
    sample_idx = np.empty((num_epochs * spe, 2), dtype=np.int64)
    shuffle_idx = np.empty(num_epochs * spe, dtype=np.int64)
    cum = np.empty(n + 1, dtype=np.int64)
    cum[0] = 0
    for epoch in range(num_epochs):
        order = _order(n, seed, epoch, _DOC_SALT, shuffle)
        np.cumsum(sizes[order], out=cum[1:])
        # 'right' skips empty documents: the owner of position s is the last doc starting at <= s.
        pos = np.searchsorted(cum, starts, side="right") - 1
        rows = slice(epoch * spe, (epoch + 1) * spe)
        doc_idx[epoch * n : (epoch + 1) * n] = order
        sample_idx[rows, 0] = pos + epoch * n
        sample_idx[rows, 1] = starts - cum[pos]
        shuffle_idx[rows] = _order(spe, seed, epoch, _SAMPLE_SALT, shuffle) + epoch * spe
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _group_until_overflow(sizes_in_order: np.ndarray, capacity: int, allow_chopped: bool) -> np.ndarray:
    """Greedy packing of documents (in order) into samples of ``capacity`` tokens -> [S, 2] ranges.

    Greedy packing is inherently sequential; it runs once per epoch over documents (not tokens),
    which post-training corpora keep small.
    """
    ranges: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes_in_order.tolist()):
        if size > capacity:
            if used:
                ranges.append((start, i))
            if allow_chopped:
                ranges.append((i, i + 1))
            start, used = i + 1, 0
            continue
        if size == 0:
            continue
        if used + size > capacity:
            ranges.append((start, i))
            start, used = i, 0
        used += size
    if used:
        ranges.append((start, len(sizes_in_order)))
    return np.asarray(ranges, dtype=np.int64).reshape(-1, 2)


def build_document_index(
    sizes: np.ndarray,
    seq_length: int,
    seed: int,
    num_samples: int,
    pack_impl: PackImpl,
    allow_chopped: bool = True,
    shuffle: Shuffle = True,
) -> dict[str, np.ndarray]:
    """``pack_until_overflow`` or ``unpacked`` index: each sample is a range of whole documents."""
    sizes = _check(sizes, seq_length)
    n = sizes.size
    capacity = seq_length + 1
    doc_idx_parts, sample_parts, shuffle_parts = [], [], []
    total = 0
    epoch = 0
    while total < num_samples or epoch == 0:
        order = _order(n, seed, epoch, _DOC_SALT, shuffle)
        ordered = sizes[order]
        if pack_impl == "unpacked":
            # One document per sample; a long one is truncated to L + 1, or dropped without allow_chopped.
            fits = ordered > 0 if allow_chopped else (ordered > 0) & (ordered <= capacity)
            keep = np.flatnonzero(fits)
            ranges = np.stack([keep, keep + 1], axis=1)
        elif pack_impl == "pack_until_overflow":
            ranges = _group_until_overflow(ordered, capacity, allow_chopped)
        else:
            raise DataError(f"unknown pack_impl {pack_impl!r}; expected one of {PACK_IMPLS}")
        if len(ranges) == 0:
            raise DataError(
                f"no document fits in seq_length + 1 = {capacity} tokens; set allow_chopped: true "
                "or raise seq_length"
            )
        doc_idx_parts.append(order)
        sample_parts.append(ranges + epoch * n)
        shuffle_parts.append(_order(len(ranges), seed, epoch, _SAMPLE_SALT, shuffle) + total)
        total += len(ranges)
        epoch += 1
    return {
        "doc_idx": np.concatenate(doc_idx_parts).astype(np.int64),
        "sample_idx": np.concatenate(sample_parts),
        "shuffle_idx": np.concatenate(shuffle_parts).astype(np.int64),
    }


def build_sample_index(
    sizes: np.ndarray,
    seq_length: int,
    seed: int,
    num_samples: int,
    pack_impl: PackImpl = "packed",
    allow_chopped: bool = True,
    shuffle: Shuffle = True,
) -> dict[str, np.ndarray]:
    """Dispatch on ``pack_impl``; see the module docstring for the layouts (``shuffle``: ``data_shuffle``)."""
    if pack_impl == "packed":
        return build_packed_index(sizes, seq_length, seed, num_samples, shuffle)
    return build_document_index(sizes, seq_length, seed, num_samples, pack_impl, allow_chopped, shuffle)


Span = tuple[int, int, int]  # (document id, token offset, length)


def packed_spans(
    doc_idx: np.ndarray, sample_idx: np.ndarray, sizes: np.ndarray, row: int, seq_length: int
) -> list[Span]:
    """The document pieces making up ``packed`` sample ``row`` (``seq_length + 1`` tokens in all)."""
    pos, offset = int(sample_idx[row, 0]), int(sample_idx[row, 1])
    need = seq_length + 1
    spans: list[Span] = []
    while need > 0:
        doc = int(doc_idx[pos])
        take = min(int(sizes[doc]) - offset, need)
        if take > 0:
            spans.append((doc, offset, take))
            need -= take
        pos += 1
        offset = 0
        if pos >= len(doc_idx) and need > 0:
            # Only reachable for the last sample of the last epoch: the next epoch's stream is
            # not built, but the epoch's sample count guarantees enough tokens. Guard anyway.
            raise DataError("sample index is inconsistent with the data; delete the index cache")
    return spans


def document_spans(
    doc_idx: np.ndarray, sample_idx: np.ndarray, sizes: np.ndarray, row: int, seq_length: int
) -> list[Span]:
    """The whole documents of a ``pack_until_overflow``/``unpacked`` sample, truncated to L + 1."""
    lo, hi = int(sample_idx[row, 0]), int(sample_idx[row, 1])
    need = seq_length + 1
    spans: list[Span] = []
    for pos in range(lo, hi):
        doc = int(doc_idx[pos])
        take = min(int(sizes[doc]), need)
        if take > 0:
            spans.append((doc, 0, take))
            need -= take
        if need == 0:
            break
    return spans
