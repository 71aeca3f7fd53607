"""From a micro-batch of samples to model inputs, labels and loss mask.

A sample's ``text`` holds ``seq_length + 1`` tokens: the inputs are the first ``seq_length``,
the labels the last ``seq_length`` (next-token prediction). An optional ``label`` array replaces
the shifted text as targets (SFT: ``-100`` = not counted). Every rank reads its own micro-batches
from the sampler, so no broadcast of data across tensor-parallel ranks is needed: ranks of one
tensor-parallel group share a data-parallel rank and read the same samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron.errors import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LMBatch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64, negative = not counted
    loss_mask: torch.Tensor  # [b, s] float 0/1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def lm_batch(sample: dict[str, torch.Tensor], eod_token: int | None = None,
             device: torch.device | str | None = None) -> LMBatch:
    """Split a collated micro-batch into inputs/labels/mask.

    ``eod_token``: when given, predictions *of* the end-of-document token are not counted
    (GPT-NeoX ``eod_mask_loss``).
    """
    if "text" not in sample:
        raise DataError(f"a training sample needs a 'text' array; got keys {sorted(sample)}")
    text = _to(sample["text"], device).long()
    if text.ndim != 2 or text.shape[1] < 2:
        raise DataError(f"'text' must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(text.shape)}")
    tokens = text[:, :-1]
    if "label" in sample:
        labels = _to(sample["label"], device).long()[:, 1:]
    else:
        labels = text[:, 1:]
    mask = (labels != IGNORE_INDEX).float()
    if eod_token is not None:
        mask = mask * (labels != eod_token).float()
    # masked positions also get a negative label so the loss ignores them either way
    labels = torch.where(mask > 0, labels, torch.full_like(labels, IGNORE_INDEX))
    return LMBatch(tokens.contiguous(), labels.contiguous(), mask)


def _to(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """The sample on the device first, then sliced and masked there: one copy per array, and
    asynchronous when the prefetcher pinned it (a copy from ordinary memory makes the host wait)."""
    return t if device is None else t.to(device, non_blocking=True)


def pipe_batches(micro_batches: Iterator[dict[str, torch.Tensor]], eod_token: int | None = None,
                 device: torch.device | str | None = None) -> Iterator[tuple[Any, Any]]:
    """The ``(inputs, labels)`` pairs DeepSpeed's ``PipelineEngine`` pulls: the first stage feeds
    ``tokens`` to the embedding, the last stage hands ``(labels, loss_mask)`` to ``loss_fn``."""
    for sample in micro_batches:
        b = lm_batch(sample, eod_token, device)
        yield b.tokens, (b.labels, b.loss_mask)
