"""The pure arithmetic of ``train_data_weights_schedule`` (no numpy: the checks before launch use it too): which
``*_data_paths`` entries name jsonl shards, each step's data offset, Levanter's stage rules and weight normalisation
(``src/levanter/data/mixture.py`` @ 9263f81e). The mixture itself is ``megatron/data/mixture.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.data.batch_schedule import BatchSchedule
from megatron.errors import DataError

MAX_BLOCK_SIZE = 2**16
"""Levanter packs the source and its index into one id (16 bits each): the block must be below this."""

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")

Stage = tuple[int, list[float]]
"""``(first global sample, one weight per source)``."""


def names_jsonl_shards(path: str) -> bool:
    """A ``*_data_paths`` entry that names raw jsonl shards (a path or brace pattern ending in .jsonl, .jsonl.gz or
    .jsonl.zst): it is tokenized once into ``cache_dir`` as ``train_urls`` are (``url_sources.materialize_urls``)."""
    return str(path).endswith(JSONL_SUFFIXES)


def stages_at_offsets(schedule: Sequence[Sequence[Any]], batches: BatchSchedule) -> list[Stage]:
    """``train_data_weights_schedule`` (``[step, [w, ...]]`` pairs) with each step replaced by its data offset, as
    Levanter's ``rescale_mixture_schedule_for_batch_schedule`` does (mixture.py:310-341@9263f81e)."""
    return [(batches.offset_at(int(step)), [float(w) for w in weights]) for step, weights in schedule]


def normalized(weights: Sequence[float]) -> list[float]:
    """Levanter's ``_normalize_weights``: each weight over their sum (the sum taken left to right), zeros kept as 0."""
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise DataError(f"mixture weights must be non-negative with a positive sum, got {list(weights)}")
    return [w / total if w > 0 else 0.0 for w in weights]


def stage_problems(stages: Sequence[Stage], block_size: int) -> list[str]:
    """What Levanter asserts of the stages (mixture.py:68-80@9263f81e): the first at sample 0, the others at
    increasing multiples of the block."""
    problems = []
    for i, (start, _) in enumerate(stages):
        if i == 0 and start != 0:
            problems.append(f"the first stage starts at sample {start}, not 0")
        elif i and start % block_size:
            problems.append(f"stage {i} starts at sample {start}, not a multiple of the block of {block_size}")
        elif i and start <= stages[i - 1][0]:
            problems.append(f"stage {i} starts at sample {start}, not after stage {i - 1} (sample {stages[i - 1][0]})")
    return problems
