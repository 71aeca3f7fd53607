"""Precomputed reference log-probs: the on-disk format, its writer and its reader.

For ``reference_logps: P`` the reference log-probs of split ``S`` (``train``, ``valid``, ``test``) are

* ``P_S.npy``: float32 ``[rows, 2]``; row ``i`` belongs to global sample ``i`` of the split, in the
  order the run reads its samples (a pure function of the data, ``seed`` and ``seq_length``; see
  ``megatron/data/sampler.py``). DPO: ``[log ref(chosen), log ref(rejected)]``; KTO:
  ``[log ref(completion), log ref(mismatched completion)]`` - the mismatched pair of sample ``i`` is
  built inside its micro-batch (``kto.py``), so a KTO file holds for one micro-batch size. Each value is
  the sum over the response's counted tokens (labels != -100), as ``sequence_logps`` computes it.
* ``P_S.json``: ``{"format": 1, "train_impl", "split", "rows", "seq_length", "seed",
  "micro_batch_size"}``, checked against the run before any row is read.

A run needs ``train_iters x train_batch_size`` train rows and, with evaluation, as many valid/test
rows as its evaluations read. :func:`compute_reference_logps` + :func:`write_reference_logps` build
the files from any forward function (the tests use a plain ``GPTModel``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron.atomic_files import atomic_path, atomic_write_text
from megatron.data.sampler import collate
from megatron.errors import ConfigError, DataError
from megatron.training.objectives.base import Objective

FORMAT_VERSION = 1


def reference_paths(prefix: str, split: str) -> tuple[Path, Path]:
    return Path(f"{prefix}_{split}.npy"), Path(f"{prefix}_{split}.json")


@dataclass(frozen=True)
class ReferenceMeta:
    train_impl: str
    split: str
    rows: int
    seq_length: int
    seed: int
    micro_batch_size: int

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, **self.__dict__}, indent=1)


def write_reference_logps(prefix: str, meta: ReferenceMeta, values: np.ndarray) -> Path:
    """Write ``values`` ``[rows, 2]`` and its metadata for ``meta.split``; returns the .npy path."""
    values = np.asarray(values, dtype=np.float32)
    if values.ndim != 2 or values.shape != (meta.rows, 2):
        raise ValueError(f"reference log-probs must be [{meta.rows}, 2], got {values.shape}")
    npy, side = reference_paths(prefix, meta.split)
    with atomic_path(npy) as tmp:
        with open(tmp, "wb") as handle:
            np.save(handle, values)
    atomic_write_text(side, meta.to_json())
    return npy


def compute_reference_logps(objective: Objective, forward: Callable[[torch.Tensor], torch.Tensor],
                            dataset: Any, rows: int, micro_batch_size: int) -> np.ndarray:
    """``[rows, 2]`` reference log-probs of global samples ``0..rows-1`` with the model ``forward``.

    Samples go through ``objective.prepare`` in the micro-batches a run forms (consecutive, aligned
    groups of ``micro_batch_size``), so KTO's mismatched rows are the ones training will build.
    """
    out = np.zeros((rows, 2), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, rows, micro_batch_size):
            batch = objective.prepare(collate([dataset[i] for i in range(start, start + micro_batch_size)]))
            logps = objective.reference_logps(forward(batch.inputs), batch.labels).float()
            first, second = logps.chunk(2)
            stop = min(start + micro_batch_size, rows)
            out[start:stop, 0] = first[: stop - start].numpy()
            out[start:stop, 1] = second[: stop - start].numpy()
    return out


class PrecomputedLogps:
    """Reads one split's file (memory-mapped) after checking it was written for this run."""

    def __init__(self, prefix: str, split: str, expected: Mapping[str, Any]) -> None:
        npy, side = reference_paths(prefix, split)
        if not npy.is_file() or not side.is_file():
            raise DataError(f"reference_logps: {npy} (and {side.name}) not found; write them with "
                            "megatron.training.objectives.precomputed.write_reference_logps, or leave "
                            "reference_logps unset to use a frozen copy of the starting weights")
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
        except ValueError as err:
            raise DataError(f"{side} is not valid JSON: {err}") from None
        if meta.get("format") != FORMAT_VERSION:
            raise DataError(f"{side}: format {meta.get('format')!r}, this Deepy reads {FORMAT_VERSION}")
        wrong = [f"{key}: file {meta.get(key)!r}, run {value!r}" for key, value in expected.items()
                 if meta.get(key) != value]
        if wrong:
            raise ConfigError(f"reference_logps {npy} was written for another run ({'; '.join(wrong)}): "
                              "its rows follow that run's sample order; recompute it")
        self.path = npy
        self.values = np.load(npy, mmap_mode="r")
        if self.values.ndim != 2 or self.values.shape[1] != 2 or self.values.shape[0] != meta.get("rows"):
            raise DataError(f"{npy}: expected [{meta.get('rows')}, 2] float32 values, found {self.values.shape}")

    def require_rows(self, count: int) -> None:
        if self.values.shape[0] < count:
            raise DataError(f"{self.path} has {self.values.shape[0]} rows but the run reads {count} samples of "
                            "this split: it was computed for a shorter schedule; recompute it")

    def rows(self, sample_index: torch.Tensor) -> torch.Tensor:
        """``[2m]`` reference log-probs: first column of every sample, then the second column."""
        index = sample_index.long().cpu().numpy()
        if index.size and int(index.max()) >= self.values.shape[0]:
            raise DataError(f"{self.path} has {self.values.shape[0]} rows but the run reads sample "
                            f"{int(index.max())}: it was computed for a shorter schedule; recompute it")
        picked = torch.from_numpy(np.ascontiguousarray(self.values[index], dtype=np.float32))  # [m, 2]
        return torch.cat([picked[:, 0], picked[:, 1]])


class IndexedSamples:
    """A dataset whose samples also carry ``sample_index`` (the global index they were read at)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.wraps = bool(getattr(dataset, "wraps", False))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {**self.dataset[i], "sample_index": np.int64(i)}
