"""Where DPO's and KTO's reference log-probs come from, behind one small interface.

* :class:`NoReference`: objectives without one, and ``dpo_reference_free`` (the log-probs are 0).
* :class:`PrecomputedReference`: DPO's ``reference_logps``: the per-token log-probs ``generate.py``
  precompute writes next to each dataset (format in ``megatron/generation/precompute.py``) ride in the
  samples (``PairwiseDataset``) and ``DPOObjective.prepare`` sums them; this only checks they came.
* :class:`FrozenReference`: computed before each step by a frozen copy of the starting weights
  (``frozen.py``), for the step's micro-batches.
* :class:`BaseModelReference`: with LoRA adapters the starting weights are the frozen base itself,
  so the policy engine runs once more with its adapters switched off - no second copy of the weights.

The step calls :meth:`Reference.fill` with all of its micro-batches before the policy's first
forward, so under pipeline parallelism the reference values are ready when the last stage's loss
needs them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron.checkpointing.config import CheckpointArgs
from megatron.deepspeed_internals import separate_pipeline_loss_total
from megatron.model.lora import adapters_disabled
from megatron.training.objectives.base import MicroBatch, Objective
from megatron.training.objectives.config import ObjectiveArgs
from megatron.training.objectives.frozen import FrozenCopy, StartingPoint, starting_point


class Reference:
    """Default: no reference (``fill`` leaves the batches alone; the loss then reads zeros)."""

    def wrap_dataset(self, dataset: Any, split: str) -> Any:
        """The dataset the run reads for ``split`` (checked against the reference's needs)."""
        return dataset

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        return batches

    def capture(self, policy: Any, args_dict: dict[str, Any], checkpoint: CheckpointArgs) -> None:
        """Take the starting weights (before the run's own checkpoint load, from where ``checkpoint``'s keys
        say the run starts)."""


NoReference = Reference


class PrecomputedReference(Reference):
    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        if any(b.reference is None for b in batches):
            raise RuntimeError(f"reference_logps: the {split} samples carry no reference log-probs "
                               "(the datasets were built without them)")
        return batches


class FrozenReference(Reference):
    def __init__(self, copy: FrozenCopy, config: ObjectiveArgs) -> None:
        self.copy = copy
        self.config = config

    def capture(self, policy: Any, args_dict: dict[str, Any], checkpoint: CheckpointArgs) -> None:
        self.copy.capture(policy, starting_point(checkpoint, self.config.train_impl), args_dict)

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        values = self.copy.logps(batches, device)
        return [replace(b, reference=v.detach()) for b, v in zip(batches, values)]


class BaseModelReference(Reference):
    """The policy's own frozen base: a forward pass with every adapter off, in eval mode (no dropout,
    so no random numbers are drawn) and without gradients.

    The base never changes while adapters train, and a resumed or ``initialize_from`` run loads the
    same base, so this is the reference the run started with."""

    def __init__(self, objective: Objective, policy: Any, is_pipe: bool) -> None:
        self.objective = objective
        self.policy = policy
        self.is_pipe = is_pipe

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        module = self.policy.module
        was_training = module.training
        with adapters_disabled(module):
            if self.is_pipe:
                values = self._pipeline_logps(batches, device)
            else:
                module.eval()
                with torch.no_grad():
                    values = [self.objective.reference_logps(self.policy(b.inputs.to(device)), b.labels.to(device))
                              .detach().float() for b in batches]
        module.train(was_training)
        return [replace(b, reference=v.detach()) for b, v in zip(batches, values)]

    def _pipeline_logps(self, batches: list[MicroBatch], device: torch.device) -> list[torch.Tensor]:
        """Through the policy's own pipeline schedule, with the loss function swapped for the per-row
        log-probs (``eval_batch`` hands them to the last stage, which also computes the loss)."""
        module = self.policy.module
        loss_fn, module.loss_fn = module.loss_fn, self.objective.reference_fn
        try:
            items = [(b.inputs.to(device), (b.labels.to(device),)) for b in batches]
            with separate_pipeline_loss_total(self.policy):
                outputs = self.policy.eval_batch(iter(items), compute_loss=True, reduce_output=None,
                                                 bcast_loss=False)
        finally:
            module.loss_fn = loss_fn
        if not self.policy.is_last_stage():
            return [torch.zeros(b.labels.shape[0], device=device) for b in batches]
        return [out.float() for out in outputs]


def build_reference(objective: Objective, policy: Any, is_pipe: bool, model_config: Any,
                    ds_config: dict[str, Any], partition_method: str | None, adapters: bool = False) -> Reference:
    """The reference the objective's config asks for (a frozen copy is built here, weights later).
    ``adapters``: the policy trains LoRA adapters on a frozen base, which is then the reference."""
    kind = objective.config.reference_kind
    if kind == "precomputed":
        return PrecomputedReference()
    if kind == "frozen_copy" and adapters:
        return BaseModelReference(objective, policy, is_pipe)
    if kind == "frozen_copy":
        copy = FrozenCopy(objective, policy, is_pipe, model_config, ds_config, partition_method)
        return FrozenReference(copy, objective.config)
    return NoReference()


__all__ = ["BaseModelReference", "FrozenReference", "NoReference", "PrecomputedReference", "Reference", "StartingPoint",
           "build_reference"]
