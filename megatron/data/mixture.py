"""Mixtures whose weights change with the step (``train_data_weights_schedule``), as Levanter's block-deterministic
``MixtureDataset`` mixes them (``src/levanter/data/mixture.py`` @ 9263f81e), and ``*_data_paths`` entries that name
raw jsonl shards.

Levanter's rule, read from its code (line numbers at 9263f81e):

- the schedule is a list of ``(step, weights)``; each step becomes the data offset of that step
  (``rescale_mixture_schedule_for_batch_schedule``, mixture.py:310-341, via ``global_data_offset_by_step``), the
  first stage starts at 0 and every later stage start is a multiple of the block (asserted, mixture.py:68-80);
- the weights of a stage are normalised to sum 1, zero weights dropped (``_normalize_weights``, mixture.py:166-180);
  a source with no positive weight in any stage is left out of the mixture (mixture.py:83-87);
- global samples come in blocks of ``block_size`` (< 2^16, mixture.py:90-92): in every block of a stage, source
  ``d`` gets ``int(w_d * block_size)`` samples (the float truncated into an int32 array), and the remainder of
  the block goes to the source with the largest count, the first one on ties (np.argmax;
  ``_compute_expected_counts_per_block``, mixture.py:138-155); a source whose weight is positive but whose
  count is 0 is warned about, not refused;
- a block lists its sources' samples source by source (source ``d``'s ``j``-th of the block is ``(d << 16) + j``,
  ``_compute_unpermuted_ids``, mixture.py:157-164) and is permuted by a key folded with the block number
  (``_compute_block_assignment``, mixture.py:304-307);
- sample ``j`` of source ``d`` in block ``b`` of stage ``s`` is that source's sample
  ``j + (its samples in the stages before s) + (b - first block of s) * (its count per block in s)``
  (``_index_into_dataset_for_id``, mixture.py:219-230; ``counts_after_stage``, mixture.py:117-136): indices into a
  source continue across stages, and a finite source restarts from its beginning when they pass its end
  (``_remap_indices``, mixture.py:286-298, stop_strategy ``restart``; the other strategies raise
  NotImplementedError, mixture.py:104-106).

Deepy differs in one place: the permutation inside a block is numpy's (``default_rng([seed, block])``), not
jax's ``random.permutation(fold_in(key, block))``, so the order inside a block is not Levanter's; the counts per
block, the stage boundaries and the source indices are. A Deepy source past its end starts a new epoch of its
sample index (GPT-NeoX's, reshuffled per epoch) where Levanter repeats the same order. Global sample ``i`` depends
only on ``i``, the schedule, the block and the seed, so a resume (at any data-parallel size) is a seek.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron.data.mixture_schedule import MAX_BLOCK_SIZE, Stage, normalized, stage_problems
from megatron.errors import DataError

logger = logging.getLogger(__name__)


def counts_per_block(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Samples of each source in one block: ``int(w * block_size)`` (normalised weights; numpy's float -> int32
    truncation, as Levanter's int32 array does), the remainder to the largest count (the first on ties)."""
    counts = np.zeros(len(weights), dtype=np.int32)
    for d, w in enumerate(weights):
        counts[d] = w * block_size
    counts[int(np.argmax(counts))] += block_size - int(counts.sum())
    return counts


class MixtureIndex:
    """Global sample ``i`` -> (source, sample of that source), Levanter's block-deterministic mixture.

    ``stages``: ``(first global sample, weights per source)``, the first at 0. A source with no positive weight
    in any stage is left out of the block arithmetic (as Levanter leaves it out of its datasets), so it never
    takes a block's remainder."""

    def __init__(self, stages: Sequence[Stage], block_size: int, seed: int) -> None:
        if not 0 < block_size < MAX_BLOCK_SIZE:
            raise DataError(f"mixture_block_size must be in [1, {MAX_BLOCK_SIZE}), got {block_size}")
        problems = stage_problems(stages, block_size)
        if problems:
            raise DataError("train_data_weights_schedule: " + "; ".join(problems))
        self.num_sources = len(stages[0][1])
        if any(len(w) != self.num_sources for _, w in stages):
            raise DataError("every stage of train_data_weights_schedule needs one weight per source")
        self.block_size, self.seed = int(block_size), int(seed)
        weights = [normalized(w) for _, w in stages]
        self.kept = [d for d in range(self.num_sources) if any(w[d] > 0 for w in weights)]
        """The sources with a positive weight in some stage (Levanter's datasets, in order)."""
        self.starts = np.array([start for start, _ in stages], dtype=np.int64)
        self.counts = np.zeros((len(stages), self.num_sources), dtype=np.int64)
        """``counts[s, d]``: samples of source ``d`` in each block of stage ``s``."""
        for s, w in enumerate(weights):
            kept_counts = counts_per_block([w[d] for d in self.kept], self.block_size)
            self.counts[s, self.kept] = kept_counts
            for d in self.kept:
                if self.counts[s, d] == 0 and w[d] > 0:
                    logger.warning("mixture source %d has 0 samples in each block of stage %d but weight %s; "
                                   "raise mixture_block_size", d, s, w[d])
        blocks = np.diff(self.starts) // self.block_size
        # base[s, d]: samples of source d in the stages before s (Levanter's counts_after_stage)
        self.base = np.zeros_like(self.counts)
        self.base[1:] = np.cumsum(self.counts[:-1] * blocks[:, None], axis=0)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def stage_of_block(self, block: int) -> int:
        return int(np.searchsorted(self.starts, block * self.block_size, side="right") - 1)

    def block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the block's share of that source) of each position of block ``block``."""
        found = self._cache.get(block)
        if found is None:
            counts = self.counts[self.stage_of_block(block)]
            sources = np.repeat(np.arange(self.num_sources), counts)
            within = np.concatenate([np.arange(c) for c in counts])
            order = np.random.default_rng([self.seed, block]).permutation(self.block_size)
            found = (sources[order], within[order])
            if len(self._cache) >= 32:  # Levanter keeps 32 blocks (alru_cache(maxsize=32))
                self._cache.pop(next(iter(self._cache)))
            self._cache[block] = found
        return found

    def locate(self, i: int) -> tuple[int, int]:
        """(source, sample of the source) of global sample ``i``."""
        block, position = divmod(int(i), self.block_size)
        stage = self.stage_of_block(block)
        sources, within = self.block(block)
        d = int(sources[position])
        in_stage = block - int(self.starts[stage]) // self.block_size
        return d, int(within[position] + self.base[stage, d] + in_stage * self.counts[stage, d])

    def samples_needed(self, num_samples: int) -> np.ndarray:
        """Samples each source gives to the first ``num_samples`` global samples (whole blocks: an upper bound)."""
        blocks = -(-int(num_samples) // self.block_size)
        stage = self.stage_of_block(max(blocks - 1, 0))
        in_stage = blocks - int(self.starts[stage]) // self.block_size
        return self.base[stage] + in_stage * self.counts[stage]


class MixtureDataset:
    """Global sample ``i`` of a :class:`MixtureIndex` over ``sources`` (each indexable past its end: it wraps)."""

    wraps = True

    def __init__(self, sources: Sequence[Any], index: MixtureIndex, num_samples: int) -> None:
        if len(sources) != index.num_sources:
            raise DataError(f"{len(sources)} datasets but the mixture has {index.num_sources} sources")
        self.sources, self.index, self.num_samples = list(sources), index, int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, i: int) -> tuple[int, int]:
        return self.index.locate(i)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        d, k = self.index.locate(i)
        return self.sources[d][k]

