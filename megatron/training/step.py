"""One optimizer step: ``gradient_accumulation_steps`` micro-batches through the engine.

The objective (``eng.objective``, chosen by ``train_impl``) prepares the step's micro-batches, counts
their loss units over the whole global batch and forms the loss (``megatron/objectives``):
the reported loss and the gradients are those of the sum of per-unit losses over the global batch
divided by its number of units (counted tokens for language modelling and SFT, samples or pairs for
DPO, KTO and reward models), the same number on every layout - plain, tensor-, pipeline- or
data-parallel - whatever the micro-batch size and however the masked tokens are spread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron.deepspeed_internals import loss_scale
from megatron.engine.build import Engine
from megatron.training.objective_runner import ObjectiveRunner

__all__ = ["StepResult", "read_grad_norm", "train_step"]


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """A 0-dim tensor on the device, unread: reading it waits for the step to finish on a GPU, so the
    loop sums it as a tensor and reads it at log steps only."""
    applied: bool
    """False when fp16 loss scaling found an overflow and DeepSpeed skipped the update."""
    grad_norm: float | torch.Tensor | None
    """As the engine reports it (maybe a device tensor; -1 = not computed): see :func:`read_grad_norm`."""
    loss_scale: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's metrics for this step (``rewards/accuracy``, ...), logged as ``train/<name>``."""


def read_grad_norm(norm: float | torch.Tensor | None) -> float | None:
    """The engine's global gradient norm as a float, None when it was not computed (ZeRO reports -1)."""
    if norm is None:
        return None
    value = float(norm)
    return value if value >= 0 else None


def train_step(eng: Engine, micro_batches: Iterator[dict[str, torch.Tensor]], device: torch.device,
               seq_limit: int | None = None) -> StepResult:
    """One global batch: forward/backward on every micro-batch (its samples cut to ``seq_limit`` tokens when
    given: the sequence curriculum), then the optimizer step."""
    if eng.moe is not None:
        eng.moe.before_step(eng.engine, loss_scale(eng.engine))  # the aux losses' gradient scale
    runner = ObjectiveRunner(eng.objective, eng.reference)
    loss = runner.run(eng, micro_batches, "train", device, train=True, seq_limit=seq_limit)
    metrics = runner.collect_metrics(eng, device)
    engine = eng.engine
    return StepResult(loss=loss, applied=bool(engine.was_step_applied()), grad_norm=engine.get_global_grad_norm(),
                      loss_scale=loss_scale(engine), metrics=metrics)
