"""Batch arithmetic: ``train_batch_size = micro batch x gradient accumulation x data-parallel size``.

GPT-NeoX lets a config give any two of the three (the data-parallel size comes from the launch) and
works out the third. :func:`solve_batch` does that, and is the one place that does: before launch,
``derive_batch`` (``megatron/neox_arguments/derived.py``) calls it with the user's keys and the
data-parallel size the launch will have, reports its :class:`BatchError` as the user's config error,
and records the layout's three numbers in the resolved config (provenance ``derived`` for those the
user left out, so ``--dry-run`` shows them); the DeepSpeed config is split from those recorded numbers.

On the ranks nothing is solved or checked again: ``RunConfig`` reads the resolved micro batch and
accumulation once into a :class:`RankBatch`, :meth:`RankBatch.on` adds the real data-parallel size, and
the sampler, the evaluator and the loop read the global batch off that one object (``global_size`` is
the product, so the three cannot disagree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from megatron.data.batch_schedule import BatchSchedule
from megatron.errors import ConfigError


class BatchError(ConfigError):
    """The batch keys cannot make ``micro x gas x dp``; the message names the user's keys."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLayout:
    """One run's batch sizes, consistent by construction."""

    micro: int
    """Samples per data-parallel rank in one forward/backward (``train_micro_batch_size_per_gpu``)."""
    gas: int
    """Micro-batches accumulated before each optimizer step (``gradient_accumulation_steps``)."""
    dp: int
    """Data-parallel size: ranks that read different samples."""

    @property
    def global_size(self) -> int:
        """Samples per optimizer step over all ranks (``train_batch_size``)."""
        return self.micro * self.gas * self.dp

    @property
    def per_rank(self) -> int:
        """Samples one data-parallel rank reads per optimizer step."""
        return self.micro * self.gas

    def keys(self) -> dict[str, int]:
        """The GPT-NeoX/DeepSpeed keys this layout sets (``batch_size`` is GPT-NeoX's older name of
        the micro batch)."""
        return {"train_micro_batch_size_per_gpu": self.micro, "batch_size": self.micro,
                "gradient_accumulation_steps": self.gas, "train_batch_size": self.global_size}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankBatch:
    """The per-rank half of a resolved config's layout (``solve_batch`` filled in and checked it before
    launch): built once above (``RunConfig``) and handed down; the data-parallel size comes with the ranks."""

    micro: int
    """Samples per data-parallel rank in one forward/backward (``train_micro_batch_size_per_gpu``)."""
    gas: int
    """Micro-batches accumulated before each optimizer step (``gradient_accumulation_steps``)."""
    steps: tuple[tuple[int, int], ...] = ()
    """``train_batch_size_schedule`` as (start_step, global_batch) pairs; (): the layout's batch every step."""

    def on(self, dp: int) -> BatchLayout:
        """The run's layout on ``dp`` data-parallel ranks; nothing is solved or checked again."""
        return BatchLayout(micro=self.micro, gas=self.gas, dp=dp)

    def schedule(self, dp: int) -> BatchSchedule:
        """Each step's global batch on ``dp`` data-parallel ranks (step 0's is the layout's)."""
        return BatchSchedule.of(self.steps) if self.steps else BatchSchedule.fixed(self.on(dp).global_size)


def solve_batch(micro: int | None, gas: int | None, total: int | None, dp: int,
                show: Callable[[str], str] = str, micro_key: str = "train_micro_batch_size_per_gpu") -> BatchLayout:
    """The layout from what the user gave: ``micro`` (under the key ``micro_key``), ``gas`` and
    ``total`` (``train_batch_size``), each None when not given, on ``dp`` data-parallel ranks. Any two
    give the third; all three must agree; only ``micro`` means no accumulation; only ``total`` means
    one micro-batch per step. ``show(key)`` renders a key as the messages name it (``key=value
    (file:line)``). Raises :class:`BatchError`."""
    formula = f"train_batch_size = micro batch x gradient_accumulation_steps x data-parallel size ({dp})"
    if micro is not None and gas is not None and total is not None:
        if micro * gas * dp != total:
            raise BatchError(
                f"{show('train_batch_size')} != {show(micro_key)} x {show('gradient_accumulation_steps')} x dp {dp} "
                f"= {micro * gas * dp}: {formula}; drop one of the three to have it derived")
    elif micro is not None and total is not None:
        if total % (micro * dp) != 0:
            raise BatchError(
                f"{show('train_batch_size')} is not a multiple of {show(micro_key)} x dp {dp} = {micro * dp}: "
                f"{formula}; use a train_batch_size that is a multiple of {micro * dp}")
        gas = total // (micro * dp)
    elif gas is not None and total is not None:
        if total % (gas * dp) != 0:
            raise BatchError(
                f"{show('train_batch_size')} is not a multiple of {show('gradient_accumulation_steps')} "
                f"x dp {dp} = {gas * dp}: {formula}")
        micro = total // (gas * dp)
    elif micro is not None:
        gas = gas or 1
    elif total is not None:
        if total % dp != 0:
            raise BatchError(f"{show('train_batch_size')} is not divisible by the data-parallel size {dp}: "
                             f"{formula}; use a multiple of {dp}")
        gas, micro = 1, total // dp
    else:
        shown = f" (only {show('gradient_accumulation_steps')})" if gas is not None else ""
        raise BatchError(f"no batch size{shown}: set train_micro_batch_size_per_gpu (samples per rank per step) "
                         f"and/or train_batch_size (global samples per optimizer step)")
    return BatchLayout(micro=micro, gas=gas, dp=dp)


def eval_batch_size(global_batch: int, train: RankBatch, eval_micro: int | None) -> int:
    """Samples per evaluation batch over all ranks: ``eval_micro`` per data-parallel rank with no
    accumulation (``eval_micro_batch_size_per_gpu``, Levanter's per_device_eval_parallelism x its data
    axis, trainer.py:808-810@9263f81e); unset, a training global batch, as in GPT-NeoX."""
    if eval_micro is None:
        return global_batch
    return eval_micro * (global_batch // (train.micro * train.gas))
