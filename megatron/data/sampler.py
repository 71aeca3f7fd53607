"""Which global samples a data-parallel rank reads, as a pure function of consumed samples.

Global batch ``b`` is global samples ``[b*G, (b+1)*G)``. Data-parallel rank ``r`` of ``dp`` reads the
contiguous slice ``[b*G + r*G/dp, b*G + (r+1)*G/dp)`` and splits it into ``G / (dp * mbs)``
micro-batches of ``mbs`` samples. Since the global sequence never depends on the layout, a run resumed
with a different dp size (or micro-batch size) continues with exactly the samples the old layout would
have read next. Resuming computes the position from ``consumed_samples`` (Levanter's
``iter_from_step``): O(1), no replay of earlier batches. The sizes come from the run's
:class:`~megatron.data.batch.BatchLayout`, solved and checked once before launch; nothing here re-derives them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from megatron.data.batch import BatchLayout
from megatron.data.batch_schedule import BatchSchedule
from megatron.errors import DataError


def micro_batch_indices(batch: BatchLayout, dp_rank: int, step: int, micro: int,
                        schedule: BatchSchedule | None = None) -> np.ndarray:
    """Global sample indices of micro-batch ``micro`` of global batch ``step`` on data-parallel rank
    ``dp_rank``; with ``schedule``, step ``step`` starts at its offset and holds its own batch."""
    if schedule is None:
        start = step * batch.global_size + dp_rank * batch.per_rank + micro * batch.micro
    else:
        start = schedule.offset_at(step) + dp_rank * schedule.per_rank_at(step, batch.dp) + micro * batch.micro
    return np.arange(start, start + batch.micro, dtype=np.int64)


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into tensors; ints become int64, floats float32."""
    if not samples:
        raise DataError("cannot collate an empty micro-batch")
    keys = samples[0].keys()
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        try:
            stacked = np.stack([np.asarray(s[key]) for s in samples])
        except (KeyError, ValueError) as err:
            raise DataError(f"samples disagree on key {key!r} (missing or different shapes): {err}") from None
        if np.issubdtype(stacked.dtype, np.floating):
            out[key] = torch.from_numpy(stacked.astype(np.float32))
        else:
            out[key] = torch.from_numpy(stacked.astype(np.int64))
    return out


class MicroBatchIterator:
    """Yields this rank's micro-batches, starting exactly at ``consumed_samples``.

    Infinite: indices past the dataset's length wrap by epoch (datasets with ``wraps = True`` do it
    themselves; for others the index is taken modulo ``len(dataset)``).
    """

    def __init__(self, dataset: Any, consumed_samples: int, batch: BatchLayout, dp_rank: int = 0,
                 schedule: BatchSchedule | None = None) -> None:
        if not 0 <= dp_rank < batch.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {batch.dp})")
        self.batch, self.dp_rank = batch, dp_rank
        self.schedule = schedule or BatchSchedule.fixed(batch.global_size)
        step = self.schedule.step_at_offset(consumed_samples) if consumed_samples >= 0 else None
        if step is None:
            raise DataError(f"consumed_samples={consumed_samples} is not where a step of this run's batch schedule "
                            f"starts (global batches of {'/'.join(map(str, self.schedule.sizes))}); the checkpoint "
                            "does not match this train_batch_size (or train_batch_size_schedule)")
        if len(dataset) == 0:
            raise DataError("the dataset is empty")
        self.dataset = dataset
        self._wraps = bool(getattr(dataset, "wraps", False))
        self._batch = step
        self._micro = 0

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed by all ranks once the current global batch completes."""
        return self.schedule.offset_at(self._batch)

    def _gas(self) -> int:
        """Micro-batches of the current global batch on this rank (its batch over micro x dp)."""
        return self.schedule.gas_at(self._batch, self.batch.micro, self.batch.dp)

    def indices(self) -> np.ndarray:
        """Global indices of the next micro-batch (without advancing)."""
        return micro_batch_indices(self.batch, self.dp_rank, self._batch, self._micro, self.schedule)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        idx = self.indices()
        n = len(self.dataset)
        batch = collate([self.dataset[int(i) if self._wraps else int(i) % n] for i in idx])
        self._micro += 1
        if self._micro == self._gas():
            self._micro = 0
            self._batch += 1
        return batch


class Prefetcher:
    """Reads micro-batches `depth` ahead of the training step in one background thread.

    The step then never waits for sample reads and collation (or only when they are slower than the
    step). Samples are not pinned here: the objective shapes them into new tensors before the copy to
    the device, which pins those (:mod:`megatron.data.transfer`). Order and content are exactly the
    source's; an error raised by the source is raised by `next()` at the same position. One thread, so
    the dataset is never read concurrently.
    """

    _DONE = object()

    def __init__(self, source: Iterator[dict[str, torch.Tensor]], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self._source = source
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._fill, name="deepy-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for batch in self._source:
                self._queue.put(batch)
            self._queue.put(self._DONE)
        except BaseException as err:  # handed to the consumer, raised where the batch was expected
            self._queue.put(err)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        item = self._queue.get()
        if item is self._DONE:
            self._queue.put(item)  # stays exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            self._queue.put(item)
            raise item
        return item


def prefetched(source: Iterator[dict[str, torch.Tensor]], depth: int) -> Iterator[dict[str, torch.Tensor]]:
    """`source` read `depth` micro-batches ahead by a `Prefetcher`; `depth` 0 = the source itself."""
    return Prefetcher(source, depth) if depth > 0 else source
