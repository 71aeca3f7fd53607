"""The reference model as a frozen copy of the starting weights, sharded like the policy.

Without a pipeline it is a plain ``GPTModel`` built on the same tensor-parallel groups (each rank holds
the same shard of every weight as the policy); with one it is a second ``PipelineModule`` of the same
layer specs and partition, run forward-only by its own DeepSpeed ``PipelineEngine`` (no optimizer):
its ``loss_fn`` returns each row's summed log-probs, which ``eval_batch(reduce_output=None)`` hands to
the last stage - the stage that also computes the policy's loss. The copy never trains, is never
saved, and runs in eval mode (no dropout), so it consumes no random numbers.

**Which weights.** "Starting weights" are resolved from the configuration and the checkpoints on
disk, the same way on the first start and on every resume, so a resumed run gets the reference it
started with:

1. ``initialize_from`` (its newest committed checkpoint), else
2. ``load`` with ``finetune: true`` (at ``iteration`` or the newest), else
3. when ``load`` holds a checkpoint written by a run of the same ``train_impl`` (a resume), that run's
   own starting point, read from the arguments stored in the checkpoint, else
4. the seeded initialisation (the policy's weights before any load).

``load`` holding a checkpoint of another objective without ``finetune``/``initialize_from`` is refused:
the reference would be lost at the first resume. The weights are captured *before* the run's own
load: a checkpoint source is loaded (weights only) into the fresh policy engine and copied, then the
normal load (resume or initialize) follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from torch import nn

from megatron import mpu
from megatron.checkpointing.save_load import LoadOptions, load_checkpoint
from megatron.errors import CheckpointError
from megatron.logging.console import deepspeed_prints_quiet
from megatron.model import GPTModel, pipeline_layer_specs
from megatron.objectives.base import MicroBatch, Objective
from megatron.objectives.starting_point import StartingPoint, starting_point

log = logging.getLogger("deepy")

# keys of the DeepSpeed config a forward-only engine keeps (precision and batch arithmetic)
_INFERENCE_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "bf16", "fp16", "steps_per_print", "wall_clock_breakdown")


def _inference_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    return {key: ds_config[key] for key in _INFERENCE_KEYS if key in ds_config}


class FrozenCopy:
    """Reference log-probs from a frozen copy of the policy's starting weights."""

    def __init__(self, objective: Objective, policy: Any, is_pipe: bool, model_config: Any,
                 ds_config: dict[str, Any], partition_method: str | None) -> None:
        self.objective = objective
        self.is_pipe = is_pipe
        if is_pipe:
            with deepspeed_prints_quiet():  # PipelineModule's SEED_LAYERS=... and layer partition dump
                module = PipelineModule(layers=pipeline_layer_specs(model_config), loss_fn=objective.reference_fn,
                                        topology=mpu.get_topology(), partition_method=partition_method or "uniform")
            module.requires_grad_(False)
            self.engine, *_ = deepspeed.initialize(model=module, config=_inference_ds_config(ds_config),
                                                   dist_init_required=False)
            self.module: nn.Module = self.engine.module
        else:
            like = next(policy.module.parameters())  # the policy's device and precision
            self.module = GPTModel(model_config).to(device=like.device, dtype=like.dtype).requires_grad_(False)
            self.engine = None
        self.module.eval()

    # --- weights ---------------------------------------------------------------------------------
    def capture(self, policy: Any, source: StartingPoint, args_dict: dict[str, Any]) -> None:
        """Copy the starting weights: load ``source`` (weights only) into the fresh ``policy`` first."""
        if source.checkpoint is not None:
            load_checkpoint(policy, source.checkpoint, args_dict, LoadOptions(weights_only=True))
        state = _full_state_dict(policy)
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"the reference model does not match the policy (missing {missing}, "
                                  f"unexpected {unexpected})")
        log.info("reference model: frozen copy of %s", source)

    # --- log-probs -------------------------------------------------------------------------------
    def logps(self, batches: list[MicroBatch], device: torch.device) -> list[torch.Tensor]:
        """``[n]`` reference log-probs for each micro-batch (meaningful on the pipeline's last stage)."""
        if self.engine is None:
            with torch.no_grad():
                return [self.objective.reference_logps(self.module(b.inputs.to(device)), b.labels.to(device))
                        .detach().float() for b in batches]
        items = [(b.inputs.to(device), (b.labels.to(device),)) for b in batches]
        outputs = self.engine.eval_batch(iter(items), compute_loss=True, reduce_output=None, bcast_loss=False)
        if not self.engine.is_last_stage():
            return [torch.zeros(b.labels.shape[0], device=device) for b in batches]
        return [out.float() for out in outputs]


def _full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The policy module's weights; under ZeRO-3 gathered from their partitions first."""
    module = engine.module
    if int(engine.zero_optimization_stage()) == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
