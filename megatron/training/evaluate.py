"""Validation/test loss: ``eval_iters`` global batches, averaged the same way as training.

Successive evaluations see different batches: evaluation number k reads global batches
``[k * eval_iters, (k + 1) * eval_iters)`` of the split (GPT-NeoX continues the split's stream the
same way). Where it starts is a pure function of k, which is itself a function of the iteration
(:func:`evaluation_number`), rather than a position carried from one evaluation to the next: a
resumed run therefore evaluates exactly the batches the uninterrupted run would have, and nothing
about evaluation has to be stored in a checkpoint (nor kept right across a change of batch layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron.model import lm_loss
from megatron.training.batch import lm_batch, pipe_batches
from megatron.training.engine import Engine
from megatron.training.step import average_over_data_parallel, micro_batches_per_step


StreamAt = Callable[[int], Iterator[dict[str, torch.Tensor]]]
"""This rank's micro-batches of a split, starting at a given global batch."""


def evaluation_number(iteration: int, eval_interval: int | None) -> int:
    """How many validation evaluations came before the one at ``iteration``: the periodic ones
    at every multiple of ``eval_interval`` and a last one at the end of training that is not on a
    multiple (a run that ends on a multiple evaluates once there)."""
    if not eval_interval:
        return 0
    return max(iteration - 1, 0) // eval_interval


class Evaluator:
    """One split's batches, turned into a loss over ``eval_iters`` global batches per evaluation."""

    def __init__(self, eng: Engine, stream_at: StreamAt, eval_iters: int, device: torch.device,
                 eod_token: int | None = None) -> None:
        self.eng = eng
        self.eval_iters = eval_iters
        self.device = device
        self.eod_token = eod_token
        self._stream_at = stream_at
        self._micro: Iterator[dict[str, torch.Tensor]] = iter(())
        self._pipe: Iterator[Any] | None = None

    def loss(self, evaluation: int = 0) -> float:
        """Mean loss over global batches ``[evaluation * eval_iters, (evaluation + 1) * eval_iters)``
        of the split (every rank gets the same value)."""
        self._micro = self._stream_at(evaluation * self.eval_iters)
        self._pipe = pipe_batches(self._micro, self.eod_token, self.device) if self.eng.is_pipe else None
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

    def stream_at(global_batch: int) -> MicroBatchIterator:
        # O(1): the sample order is a pure function of the position (see data/sampler.py)
        return MicroBatchIterator(dataset, global_batch * layout["global_batch_size"], **layout)

    return Evaluator(eng, stream_at, eval_iters, device, eod_token)
