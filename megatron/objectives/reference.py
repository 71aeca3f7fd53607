"""Where DPO's and KTO's reference log-probs come from, behind one small interface.

* :class:`NoReference`: objectives without one, and ``dpo_reference_free`` (the log-probs are 0).
* :class:`PrecomputedReference`: DPO's ``reference_logps``: the per-token log-probs ``generate.py``
  precompute writes next to each dataset (format in ``megatron/generation/precompute.py``) ride in the
  samples (``PairwiseDataset``) and ``DPOObjective.prepare`` sums them; this only checks they came.
* :class:`FrozenReference`: computed before each step by a frozen copy of the starting weights
  (``frozen.py``), for the step's micro-batches.
* :class:`BaseModelReference`: with LoRA adapters the starting weights are the frozen base plus the
  adapters the run starts with, so the policy engine runs once more with its adapters switched off (a
  start from the seeded initialisation or from a checkpoint without adapters: fresh adapters add 0) or
  set to the starting checkpoint's (a start from a LoRA checkpoint, e.g. an SFT run's) - no second copy
  of the base weights.

The step calls :meth:`Reference.fill` with all of its micro-batches before the policy's first
forward, so under pipeline parallelism the reference values are ready when the last stage's loss
needs them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import deepspeed
import torch

from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.save_load import LoadOptions, load_checkpoint, read_meta
from megatron.deepspeed_internals import separate_pipeline_loss_total
from megatron.model.lora import adapters_disabled, is_adapter_name
from megatron.objectives.base import MicroBatch, Objective
from megatron.objectives.frozen import FrozenCopy, StartingPoint, starting_point
from megatron.objectives.config import ObjectiveArgs, reference_kind

log = logging.getLogger("deepy")


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
    """The policy's own starting model: a forward pass with the adapters the run started with (none, or the
    starting checkpoint's), in eval mode (no dropout, so no random numbers are drawn) and without gradients.

    The base never changes while adapters train, and a resumed or ``initialize_from`` run loads the same
    base, so with the starting adapters this is the model the run started with (``frozen.py`` resolves the
    starting point, on the first start and on every resume alike)."""

    def __init__(self, objective: Objective, policy: Any, is_pipe: bool) -> None:
        self.objective = objective
        self.policy = policy
        self.is_pipe = is_pipe
        self.start_adapters: dict[str, torch.Tensor] | None = None
        """This rank's adapter tensors at the starting point, when it holds trained ones (None: fresh adapters,
        whose output is 0, so switching them off gives the starting model)."""

    def capture(self, policy: Any, args_dict: dict[str, Any], checkpoint: CheckpointArgs) -> None:
        source = starting_point(checkpoint, self.objective.config.train_impl)
        if source.checkpoint is None or not int((read_meta(source.checkpoint).get("args") or {}).get("lora_r") or 0):
            log.info("reference model: the frozen base (adapters off) of %s", source)
            return
        load_checkpoint(policy, source.checkpoint, args_dict, LoadOptions(weights_only=True))
        params = _adapter_parameters(policy.module)
        with _gathered(policy, params, modify=False):
            self.start_adapters = {name: p.detach().clone() for name, p in params.items()}
        log.info("reference model: the frozen base with the adapters of %s", source)

    @contextlib.contextmanager
    def _starting_model(self, module: Any) -> Iterator[None]:
        """``module`` as the run started: adapters off, or set to the starting checkpoint's."""
        if self.start_adapters is None:
            with adapters_disabled(module):
                yield
            return
        params = _adapter_parameters(module)
        with _gathered(self.policy, params, modify=True), torch.no_grad():
            trained = {name: p.detach().clone() for name, p in params.items()}
            for name, p in params.items():
                p.copy_(self.start_adapters[name])
        try:
            yield
        finally:
            with _gathered(self.policy, params, modify=True), torch.no_grad():
                for name, p in params.items():
                    p.copy_(trained[name])

    def fill(self, batches: list[MicroBatch], split: str, device: torch.device) -> list[MicroBatch]:
        module = self.policy.module
        was_training = module.training
        with self._starting_model(module):
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


def _adapter_parameters(module: Any) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if is_adapter_name(name)}


def _gathered(policy: Any, params: dict[str, torch.nn.Parameter], modify: bool) -> contextlib.AbstractContextManager[Any]:
    """Whole adapter tensors inside the block: under ZeRO-3 gathered from their partitions (and, with
    ``modify``, partitioned again from rank 0's values on exit); otherwise they are whole already."""
    if int(policy.zero_optimization_stage()) != 3 or not params:
        return contextlib.nullcontext()

    return deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0 if modify else None)


def build_reference(objective: Objective, policy: Any, is_pipe: bool, model_config: Any,
                    ds_config: dict[str, Any], partition_method: str | None, adapters: bool = False) -> Reference:
    """The reference the objective's config asks for (a frozen copy is built here, weights later).
    ``adapters``: the policy trains LoRA adapters on a frozen base, which is then the reference."""
    kind = reference_kind(objective.config)
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
