"""One optimizer step: ``gradient_accumulation_steps`` micro-batches through the engine.

The reported loss is the mean of the micro-batch losses over the step's micro-batches and then
over data-parallel ranks, which is exactly what DeepSpeed's ``PipelineEngine.train_batch`` returns;
so every layout (plain, tensor-, pipeline-, data-parallel) reports the same number for the same
global batch. The gradients are those of that same mean (``engine.backward`` divides by the
accumulation steps, the data-parallel all-reduce averages).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.deepspeed_internals import loss_scale
from megatron.model import lm_loss
from megatron.training.batch import lm_batch
from megatron.training.engine import Engine


@dataclass(frozen=True)
class StepResult:
    loss: float
    applied: bool
    """False when fp16 loss scaling found an overflow and DeepSpeed skipped the update."""
    grad_norm: float | None
    loss_scale: float | None


def micro_batches_per_step(engine: Any) -> int:
    return int(engine.gradient_accumulation_steps())


def average_over_data_parallel(value: torch.Tensor) -> float:
    """Mean of a scalar over the data-parallel group (identical on every rank afterwards)."""
    value = value.detach().float().clone()
    size = mpu.get_data_parallel_world_size()
    if size > 1:
        dist.all_reduce(value, group=mpu.get_data_parallel_group())
        value /= size
    return float(value)


def _grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    return norm if norm >= 0 else None  # ZeRO reports -1 for "not computed"


def train_step(eng: Engine, micro_batches: Iterator[dict[str, torch.Tensor]],
               pipe_batches: Iterator[Any] | None, device: torch.device,
               eod_token: int | None = None) -> StepResult:
    """One global batch: forward/backward on every micro-batch, then the optimizer step."""
    engine = eng.engine
    if eng.moe is not None:
        eng.moe.before_step(engine, loss_scale(engine))
    if eng.is_pipe:
        # PipelineEngine runs the whole schedule and returns the loss averaged over micro-batches
        # and data-parallel ranks, broadcast to every stage
        loss = float(engine.train_batch(pipe_batches))
    else:
        losses = []
        for _ in range(micro_batches_per_step(engine)):
            b = lm_batch(next(micro_batches), eod_token, device)
            logits = engine(b.tokens)  # [b, s, v/tp]
            step_loss = lm_loss(logits, b.labels, b.loss_mask)
            engine.backward(step_loss)
            engine.step()  # applies the update only at the accumulation boundary
            losses.append(step_loss.detach())
        loss = average_over_data_parallel(torch.stack(losses).mean())
    return StepResult(loss=loss, applied=bool(engine.was_step_applied()), grad_norm=_grad_norm(engine),
                      loss_scale=loss_scale(engine))
