"""What every training objective provides, and the normalisation they share.

An objective turns a collated micro-batch of samples into a :class:`MicroBatch` (model inputs,
labels, objective-specific targets and the number of *loss units* it holds: counted tokens for
language modelling, samples or pairs for the others) and turns the model's output into a loss.

**Normalisation.** The loss of a step is the sum of per-unit losses over the whole global batch
divided by the global number of units ``N``, counted from the labels of every micro-batch before the
first forward and summed over data-parallel ranks. Each micro-batch returns
``sum_mb / (N / (gas * dp))``: DeepSpeed averages micro-batch losses over the ``gas`` accumulation
steps and the ``dp`` ranks, so the gradient and the reported loss are exactly ``sum / N`` on every
layout, whatever the micro-batch size and however the masked tokens are spread. (Unmasked samples of
equal length give ``N / (gas * dp) = micro-batch tokens``: the plain per-micro-batch mean, bit for bit.)

**Metrics** are kept as (sum, count) pairs over the step and reduced the same way, so a mean over,
e.g., the desirable samples of a KTO batch is over all of them, not a mean of micro-batch means.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, overload

import torch

from megatron.data.transfer import to_device
from megatron.errors import DataError
from megatron.objectives.config import ObjectiveArgs

IGNORE_INDEX = -100

Stats = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""metric name -> (sum over this micro-batch, number of items it averages over)."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the model and the loss read it."""

    inputs: torch.Tensor
    """``[n, s]`` int64 token ids fed to the model (``n`` = rows, e.g. chosen then rejected)."""
    labels: torch.Tensor
    """``[n, s]`` int64 targets, ``-100`` = no loss: the tokens whose log-probs are summed."""
    extras: tuple[torch.Tensor, ...] = ()
    """Objective-specific targets (KTO rewards, reward-model score positions)."""
    units: float = 0.0
    """Loss units in this micro-batch (counted tokens or samples), for the global normaliser."""
    reference: torch.Tensor | None = None
    """``[n]`` reference log-probs per row, once the reference provided them."""
    position_ids: torch.Tensor | None = None
    """``[n, s]`` positions when they are not 0..s-1 (``reset_position_ids``)."""
    document_ids: torch.Tensor | None = None
    """``[n, s]`` document of each token when documents must not see each other (``reset_attention_mask``)."""

    def to(self, device: torch.device | str) -> MicroBatch:
        """On ``device``; to a GPU through pinned memory, so the host does not wait for the device."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_device(t, device)

        return replace(self, inputs=to_device(self.inputs, device), labels=to_device(self.labels, device),
                       extras=tuple(to_device(x, device) for x in self.extras), reference=move(self.reference),
                       position_ids=move(self.position_ids), document_ids=move(self.document_ids))

    def context_piece(self, rank: int, pieces: int) -> MicroBatch:
        """This context-parallel rank's contiguous ``s / pieces`` of every row (``megatron/mpu/context_parallel.py``):
        its tokens, labels and positions (always explicit: the piece does not start at 0), and its loss
        units. ``document_ids`` stay whole: attention sees the whole sequence."""
        s = self.inputs.shape[1]
        if s % pieces:
            raise DataError(f"sequence length {s} does not split into {pieces} context-parallel pieces")
        lo, hi = rank * s // pieces, (rank + 1) * s // pieces
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(s, device=self.inputs.device).expand_as(self.inputs).contiguous()
        labels = self.labels[:, lo:hi]
        return replace(self, inputs=self.inputs[:, lo:hi].contiguous(), labels=labels.contiguous(),
                       position_ids=positions[:, lo:hi].contiguous(),
                       units=float((labels >= 0).sum()))

    def truncated(self, length: int) -> MicroBatch:
        """The first ``length`` tokens of every row (the sequence curriculum, ``training/curriculum.py``): tokens,
        labels, positions and documents cut as GPT-NeoX's ``get_batch_pipe`` cuts them, loss units recounted."""
        if length >= self.inputs.shape[1]:
            return self
        labels = self.labels[:, :length].contiguous()

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, :length].contiguous()

        return replace(self, inputs=self.inputs[:, :length].contiguous(), labels=labels,
                       position_ids=cut(self.position_ids), document_ids=cut(self.document_ids),
                       units=float((labels >= 0).sum()))

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs of ``GPTModel.forward`` besides the tokens (none for plain samples)."""
        kwargs = {"position_ids": self.position_ids, "document_ids": self.document_ids}
        return {name: value for name, value in kwargs.items() if value is not None}

    def pipe_inputs(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The input side of a pipeline batch: tokens, or ``(tokens, position_ids[, document_ids])``
        (``megatron/model/pipeline.py``)."""
        if self.position_ids is None and self.document_ids is None:
            return self.inputs
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(self.inputs.shape[1], device=self.inputs.device).expand_as(self.inputs).contiguous()
        if self.document_ids is None:
            return self.inputs, positions
        return self.inputs, positions, self.document_ids

    def targets(self, denominator: float | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The label side of a pipeline batch: ``(labels, *extras, reference, denominator)``."""
        reference = self.reference if self.reference is not None else torch.zeros(self.labels.shape[0])
        if isinstance(denominator, torch.Tensor):
            denom = denominator.detach().reshape(1).to(torch.float64)
        else:
            denom = torch.tensor([denominator], dtype=torch.float64)
        return (self.labels, *self.extras, reference.to(self.labels.device),
                denom.to(self.labels.device))


def shifted(sample: Mapping[str, torch.Tensor], text_key: str, label_key: str | None,
            eod_token: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``text[:, :-1]`` and targets ``label[:, 1:]`` (or the shifted text), masked.

    Masked targets (label -100, and the end-of-document token when ``eod_token`` is given) become
    -100 so every consumer skips them the same way.
    """
    if text_key not in sample:
        raise DataError(f"this objective needs a {text_key!r} array in every sample; got keys {sorted(sample)}")
    text = sample[text_key].long()
    if text.ndim != 2 or text.shape[1] < 2:
        raise DataError(f"{text_key!r} must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(text.shape)}")
    labels = sample[label_key].long()[:, 1:] if label_key and label_key in sample else text[:, 1:]
    keep = labels != IGNORE_INDEX
    if eod_token is not None:
        keep &= labels != eod_token
    labels = torch.where(keep, labels, torch.full_like(labels, IGNORE_INDEX))
    return text[:, :-1].contiguous(), labels.contiguous()


@overload
def micro_batch_denominator(global_units: torch.Tensor, micro_batches: int, dp_size: int) -> torch.Tensor: ...


@overload
def micro_batch_denominator(global_units: float, micro_batches: int, dp_size: int) -> float: ...


def micro_batch_denominator(global_units: float | torch.Tensor, micro_batches: int,
                            dp_size: int) -> float | torch.Tensor:
    """What each micro-batch divides its loss sum by so the step's loss is ``sum / global_units``.

    A tensor stays a tensor (on its device): reading the count back would make the host wait for the
    previous step on a GPU."""
    if isinstance(global_units, torch.Tensor):
        return global_units.clamp(min=1.0) / float(micro_batches * dp_size)
    return max(float(global_units), 1.0) / float(micro_batches * dp_size)


@dataclass
class MetricSums:
    """(sum, count) per metric name over the micro-batches of one step or evaluation.

    Kept as float64 tensors where the loss was computed, not read back per micro-batch (a read waits
    for the GPU): they are read once, when the step's metrics are collected."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, stats: Stats) -> None:
        for name, (total, count) in stats.items():
            total, count = total.detach().double().reshape(()), count.detach().double().reshape(())
            self.sums[name] = self.sums[name] + total if name in self.sums else total
            self.counts[name] = self.counts[name] + count if name in self.counts else count

    def reset(self) -> None:
        self.sums.clear()
        self.counts.clear()

    def as_vector(self, names: Iterable[str], device: torch.device | str | None = None) -> torch.Tensor:
        """``[sum_0, count_0, sum_1, ...]`` float64 on ``device``, zeros for names never added (for
        all-reduces)."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        values: list[torch.Tensor] = []
        for name in names:
            values += [self.sums.get(name, zero).to(zero.device), self.counts.get(name, zero).to(zero.device)]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device)


def means_from_vector(names: tuple[str, ...], vector: torch.Tensor) -> dict[str, float]:
    """Inverse of :meth:`MetricSums.as_vector` after reduction; names with no items are left out."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        total, count = float(vector[2 * i]), float(vector[2 * i + 1])
        if count > 0:
            out[name] = total / count
    return out


def count(x: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


class Objective(ABC):
    """One ``train_impl``: batch preparation, the loss, its metrics and what a reference must provide."""

    train_impl: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]] = ()
    """Metrics reported as ``train/<name>`` / ``eval/<name>`` (besides the loss)."""
    uses_reference: ClassVar[bool] = False
    """Whether the loss reads per-row reference log-probs (DPO, KTO)."""
    value_head: ClassVar[bool] = False
    """Whether the model ends in a scalar head instead of the LM head."""
    new_parameters: ClassVar[tuple[str, ...]] = ()
    """``GPTModel`` name prefixes of parameters a language-model checkpoint lacks: starting from one
    (``initialize_from``/``finetune``) they keep their initialisation and everything else loads."""
    rows_per_sample: ClassVar[int] = 1
    """Model rows one sample becomes (2: both sides of a pair, or a completion and its mismatch)."""
    fp16_cross_entropy: bool = False
    """Language modelling: each token's cross-entropy in the logits' dtype (fp16) instead of fp32; the engine sets
    it from the model's ``fp16_lm_cross_entropy`` (GPT-NeoX passes it to the model's loss function)."""

    def __init__(self, config: ObjectiveArgs, eod_token: int | None = None) -> None:
        # the objective's group: the shared objective keys and the plug-ins' own (its instance is composed of
        # both, ``component_groups.group``), read where they are used
        self.config = config
        self.eod_token = eod_token if config.eod_mask_loss else None
        self.document_end_token = eod_token  # where documents of a packed sample end (reset_* keys)
        self.metrics = MetricSums()

    @abstractmethod
    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        """Inputs, labels, targets and loss units of one collated micro-batch (on the CPU)."""

    @abstractmethod
    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """Sum of the per-unit losses of one micro-batch and its metric stats (pure)."""

    def reference_logps(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[n]`` per-row log-probs as the reference model must provide them."""
        raise NotImplementedError(f"train_impl {self.train_impl} has no reference model")

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the reduced means (e.g. a margin between two group means)."""
        return means

    # --- the two forms the engines call -------------------------------------------------------
    def loss(self, output: torch.Tensor, targets: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """``targets = MicroBatch.targets(denominator)``; also the ``PipelineModule`` ``loss_fn``."""
        labels, *extras, reference, denominator = targets
        total, stats = self.loss_sum(output, labels, tuple(extras), reference)
        self.metrics.add(stats)
        return total / denominator.to(total.dtype).squeeze()

    def reference_fn(self, output: torch.Tensor, targets: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """``loss_fn`` of a frozen reference pipeline: the per-row log-probs instead of a loss."""
        return self.reference_logps(output, targets[0]).detach().float()
