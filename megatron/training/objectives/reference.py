"""Where DPO's and KTO's reference log-probs come from, behind one small interface.

* :class:`NoReference`: objectives without one, and ``dpo_reference_free`` (the log-probs are 0).
* :class:`PrecomputedReference`: read by global sample index from ``reference_logps`` files
  (``precomputed.py`` defines the format); the datasets are wrapped so samples carry their index.
* :class:`FrozenReference`: computed before each step by a frozen copy of the starting weights
  (``frozen.py``), for the step's micro-batches.

The step calls :meth:`Reference.fill` with all of its micro-batches before the policy's first
forward, so under pipeline parallelism the reference values are ready when the last stage's loss
needs them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron.training.objectives.base import MicroBatch, Objective
from megatron.training.objectives.config import ObjectiveConfig
from megatron.training.objectives.frozen import FrozenCopy, StartingPoint, starting_point
from megatron.training.objectives.precomputed import IndexedSamples, PrecomputedLogps


class Reference:
    """Default: no reference (``fill`` leaves the batches alone; the loss then reads zeros)."""

    def wrap_dataset(self, dataset: Any, split: str) -> Any:
        """The dataset the run reads for ``split`` (checked against the reference's needs)."""
        return dataset

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        return batches

    def capture(self, policy: Any, args_dict: dict[str, Any]) -> None:
        """Take the starting weights (before the run's own checkpoint load)."""


NoReference = Reference


class PrecomputedReference(Reference):
    def __init__(self, config: ObjectiveConfig) -> None:
        assert config.reference_logps is not None
        self.prefix = config.reference_logps
        self.expected = {"train_impl": config.train_impl, "seq_length": config.seq_length, "seed": config.seed}
        if config.train_impl == "kto":  # the mismatched rows depend on the micro-batch
            self.expected["micro_batch_size"] = config.micro_batch_size
        self._files: dict[str, PrecomputedLogps] = {}

    def _file(self, split: str) -> PrecomputedLogps:
        if split not in self._files:
            self._files[split] = PrecomputedLogps(self.prefix, split, {**self.expected, "split": split})
        return self._files[split]

    def wrap_dataset(self, dataset: Any, split: str) -> Any:
        """Samples carry their index; the split's file is opened now and must cover every sample the
        run plans to read (so a short or mismatched file fails at start-up, not mid-run)."""
        if dataset is None:
            return None
        self._file(split).require_rows(len(dataset))
        return IndexedSamples(dataset)

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        source = self._file(split)
        out = []
        for b in batches:
            if b.sample_index is None:
                raise RuntimeError("precomputed reference log-probs need samples that carry sample_index")
            out.append(replace(b, reference=source.rows(b.sample_index)))
        return out


class FrozenReference(Reference):
    def __init__(self, copy: FrozenCopy, config: ObjectiveConfig) -> None:
        self.copy = copy
        self.config = config

    def capture(self, policy: Any, args_dict: dict[str, Any]) -> None:
        self.copy.capture(policy, starting_point(self.config), args_dict)

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        values = self.copy.logps(batches, device)
        return [replace(b, reference=v.detach()) for b, v in zip(batches, values)]


def build_reference(objective: Objective, policy: Any, is_pipe: bool, model_config: Any,
                    ds_config: dict[str, Any], partition_method: str | None) -> Reference:
    """The reference the objective's config asks for (a frozen copy is built here, weights later)."""
    kind = objective.config.reference
    if kind == "precomputed":
        return PrecomputedReference(objective.config)
    if kind == "frozen_copy":
        copy = FrozenCopy(objective, policy, is_pipe, model_config, ds_config, partition_method)
        return FrozenReference(copy, objective.config)
    return NoReference()


__all__ = ["FrozenReference", "NoReference", "PrecomputedReference", "Reference", "StartingPoint",
           "build_reference"]
