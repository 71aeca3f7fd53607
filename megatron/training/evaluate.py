"""Validation/test loss: ``eval_iters`` global batches, averaged the same way as training.

Each evaluation continues the split's sample stream where the previous one stopped (GPT-NeoX
does the same), so successive evaluations see different batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron.model import lm_loss
from megatron.training.batch import lm_batch, pipe_batches
from megatron.training.engine import Engine
from megatron.training.step import average_over_data_parallel, micro_batches_per_step


class Evaluator:
    """Holds one split's micro-batch stream and turns ``eval_iters`` global batches into a loss."""

    def __init__(self, eng: Engine, micro_batches: Iterator[dict[str, torch.Tensor]], eval_iters: int,
                 device: torch.device, eod_token: int | None = None) -> None:
        self.eng = eng
        self.eval_iters = eval_iters
        self.device = device
        self.eod_token = eod_token
        self._micro = micro_batches
        self._pipe = pipe_batches(micro_batches, eod_token, device) if eng.is_pipe else None

    def loss(self) -> float:
        """Mean loss over ``eval_iters`` global batches (every rank gets the same value)."""
        engine = self.eng.engine
        total = 0.0
        for _ in range(self.eval_iters):
            if self._pipe is not None:
                # averages micro-batches and data-parallel ranks, broadcast to every stage
                total += float(engine.eval_batch(self._pipe))
            else:
                total += self._one_batch()
        return total / max(self.eval_iters, 1)

    def _one_batch(self) -> float:
        engine = self.eng.engine
        was_training = engine.module.training
        engine.eval()
        losses = []
        with torch.no_grad():
            for _ in range(micro_batches_per_step(engine)):
                b = lm_batch(next(self._micro), self.eod_token, self.device)
                losses.append(lm_loss(engine(b.tokens), b.labels, b.loss_mask).detach())
        if was_training:
            engine.train()
        return average_over_data_parallel(torch.stack(losses).mean())


def maybe_evaluator(eng: Engine, dataset: Any, eval_iters: int, layout: dict[str, int], device: torch.device,
                    eod_token: int | None) -> Evaluator | None:
    """An evaluator over ``dataset`` or None when there is nothing to evaluate."""
    from megatron.data.sampler import MicroBatchIterator

    if dataset is None or eval_iters <= 0 or len(dataset) == 0:
        return None
    stream = MicroBatchIterator(dataset, 0, **layout)
    return Evaluator(eng, stream, eval_iters, device, eod_token)
