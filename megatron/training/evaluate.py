"""Validation/test evaluation: ``eval_iters`` global batches of the run's objective.

The loss of each batch is normalised as in training (the objective's units over the whole global
batch) and the batches are averaged; the objective's metrics (DPO reward accuracy, reward-model
accuracy, ...) are summed over all ``eval_iters`` batches before they are averaged. Each evaluation
continues the split's sample stream where the previous one stopped (GPT-NeoX does the same), so
successive evaluations see different batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron.training.engine import Engine
from megatron.training.objectives.run import ObjectiveRunner


class Evaluator:
    """Holds one split's micro-batch stream and turns ``eval_iters`` global batches into metrics."""

    def __init__(self, eng: Engine, micro_batches: Iterator[dict[str, torch.Tensor]], eval_iters: int,
                 device: torch.device, split: str = "valid") -> None:
        self.eng = eng
        self.eval_iters = eval_iters
        self.device = device
        self.split = split
        self._micro = micro_batches

    def evaluate(self) -> dict[str, float]:
        """``{"lm_loss": mean loss, **objective metrics}``, the same on every rank."""
        runner = ObjectiveRunner(self.eng.objective, self.eng.reference)
        self.eng.objective.metrics.reset()
        total = 0.0
        for _ in range(self.eval_iters):
            total += float(runner.run(self.eng, self._micro, self.split, self.device, train=False))
        return {"lm_loss": total / max(self.eval_iters, 1), **runner.collect_metrics(self.eng, self.device)}


def maybe_evaluator(eng: Engine, dataset: Any, eval_iters: int, layout: dict[str, int], device: torch.device,
                    split: str) -> Evaluator | None:
    """An evaluator over ``dataset`` or None when there is nothing to evaluate."""
    from megatron.data.sampler import MicroBatchIterator

    if dataset is None or eval_iters <= 0 or len(dataset) == 0:
        return None
    stream = MicroBatchIterator(eng.reference.wrap_dataset(dataset, split), 0, **layout)
    return Evaluator(eng, stream, eval_iters, device, split)
