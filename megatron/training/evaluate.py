"""Validation/test evaluation: ``eval_iters`` global batches of the run's objective.

A batch is the training global batch, or with ``eval_micro_batch_size_per_gpu`` that many samples per
data-parallel rank and no accumulation (Levanter's eval batch: per_device_eval_parallelism x the data
axis, trainer.py:808-810@9263f81e), so ``eval_iters`` x that many examples are evaluated.

The loss of each batch is normalised as in training (the objective's units over the whole global
batch) and the batches are averaged; the objective's metrics (DPO reward accuracy, reward-model
accuracy, ...) are summed over all ``eval_iters`` batches before they are averaged.

Successive evaluations see different batches: evaluation number k reads global batches
``[k * eval_iters, (k + 1) * eval_iters)`` of the split (GPT-NeoX continues the split's stream the
same way). Where it starts is a pure function of k, which is itself a function of the iteration
(:func:`evaluation_number`), rather than a position carried from one evaluation to the next: a
resumed run therefore evaluates exactly the batches the uninterrupted run would have, and nothing
about evaluation has to be stored in a checkpoint (nor kept right across a change of batch layout).

With ``char_level_ppl`` an evaluation also reports ``lm_loss_char_lvl_ppl`` = exp(lm_loss x tokens / characters),
GPT-NeoX ea7aefd8's character-level perplexity (megatron/training.py:1590-1644, its ``CharCounter`` in
megatron/utils.py:472-500): every row of the ``text`` of every micro-batch the evaluation reads counts its tokens
(``len(row)``: seq_length + 1, the padding included, as GPT-NeoX counts) and the characters of the tokenizer's
``detokenize(row)``. GPT-NeoX counts the rows rank 0 reads; Deepy adds the counts of every data-parallel rank
(the same ratio on one rank), so the figure is the whole evaluation's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu

from megatron.data.batch import BatchLayout
from megatron.data.sampler import MicroBatchIterator
from megatron.engine.build import Engine
from megatron.training.objective_runner import ObjectiveRunner

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
    """One split's batches, turned into the objective's loss and metrics over ``eval_iters`` global
    batches per evaluation."""

    def __init__(self, eng: Engine, stream_at: StreamAt, eval_iters: int, device: torch.device,
                 split: str = "valid", micro_count: int | None = None, dp: int = 1,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        """``micro_count``: micro-batches per evaluation batch (None: the engine's accumulation steps);
        ``dp``: the data-parallel ranks, each reading as many samples as this one; ``detokenize``: the
        tokenizer's, to count characters (``char_level_ppl``; None counts none)."""
        self.eng = eng
        self.detokenize = detokenize
        self.micro_count = micro_count
        self.dp = dp
        self.eval_iters = eval_iters
        self.device = device
        self.split = split
        self._stream_at = stream_at

    def evaluate(self, evaluation: int = 0) -> dict[str, float]:
        """``{"lm_loss": mean loss, **objective metrics}`` over global batches
        ``[evaluation * eval_iters, (evaluation + 1) * eval_iters)`` of the split, the same on every rank."""
        micro = _Counted(self._stream_at(evaluation * self.eval_iters), self.detokenize)
        runner = ObjectiveRunner(self.eng.objective, self.eng.reference)
        self.eng.objective.metrics.reset()
        total = 0.0
        for _ in range(self.eval_iters):
            total += float(runner.run(self.eng, micro, self.split, self.device, train=False,
                                      micro_count=self.micro_count))
        # examples: the samples this evaluation read, over all data-parallel ranks
        out = {"lm_loss": total / max(self.eval_iters, 1), "examples": float(micro.rows * self.dp),
               **runner.collect_metrics(self.eng, self.device)}
        if self.detokenize is not None:
            tokens, chars = data_parallel_sum(micro.tokens, micro.chars)
            # GPT-NeoX's eval_results["lm_loss_char_lvl_ppl"] = exp(lm_loss * tokens_per_char)
            out["lm_loss_char_lvl_ppl"] = math.exp(out["lm_loss"] * tokens / chars) if chars else math.inf
        return out


def data_parallel_sum(*counts: int) -> tuple[float, ...]:
    """``counts`` added up over the data-parallel ranks (themselves without a process group)."""
    group = mpu.get_data_parallel_group()
    table = torch.tensor(counts, dtype=torch.float64)
    if dist.is_initialized() and mpu.get_data_parallel_world_size() > 1:
        table = table.to(mpu.collective_device(group))
        dist.all_reduce(table, group=group)
    return tuple(float(x) for x in table.cpu())


class _Counted:
    """A micro-batch stream that counts the samples (rows) it hands out and, given ``detokenize``, the tokens
    and characters of their ``text`` (GPT-NeoX's ``CharCounter``)."""

    def __init__(self, inner: Iterator[dict[str, torch.Tensor]],
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.inner, self.rows = inner, 0
        self.detokenize = detokenize
        self.tokens = self.chars = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.inner)
        self.rows += int(next(iter(batch.values())).shape[0])
        if self.detokenize is not None:
            for row in batch["text"]:
                self.tokens += len(row)
                self.chars += len(self.detokenize(row.tolist()))
        return batch


def maybe_evaluator(eng: Engine, dataset: Any, eval_iters: int, batch: BatchLayout, dp_rank: int,
                    device: torch.device, split: str,
                    detokenize: Callable[[list[int]], str] | None = None) -> Evaluator | None:
    """An evaluator over ``dataset`` or None when there is nothing to evaluate; ``detokenize``: count characters
    too (``char_level_ppl``)."""
    if dataset is None or eval_iters <= 0 or len(dataset) == 0:
        return None
    source = eng.reference.wrap_dataset(dataset, split)

    def stream_at(global_batch: int) -> MicroBatchIterator:
        # O(1): the sample order is a pure function of the position (see data/sampler.py)
        return MicroBatchIterator(source, global_batch * batch.global_size, batch, dp_rank)

    return Evaluator(eng, stream_at, eval_iters, device, split, micro_count=batch.gas, dp=batch.dp,
                     detokenize=detokenize)
