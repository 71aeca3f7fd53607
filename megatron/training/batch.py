"""From a micro-batch of samples to language-model inputs, labels and loss mask.

A sample's ``text`` holds ``seq_length + 1`` tokens: the inputs are the first ``seq_length``,
the labels the last ``seq_length`` (next-token prediction). An optional ``label`` array replaces
the shifted text as targets (SFT: ``-100`` = not counted). The shift and masking are the objectives'
(``megatron.training.objectives.base.shifted``); this is the language-model view of them for tools
that drive a model directly (benchmarks, tests). Every rank reads its own micro-batches from the
sampler, so no broadcast of data across tensor-parallel ranks is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.training.objectives.base import IGNORE_INDEX, shifted

__all__ = ["IGNORE_INDEX", "LMBatch", "lm_batch"]


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
    tokens, labels = shifted(sample, "text", "label", eod_token)
    batch = LMBatch(tokens, labels, (labels != IGNORE_INDEX).float())
    if device is not None:
        batch = LMBatch(batch.tokens.to(device), batch.labels.to(device), batch.loss_mask.to(device))
    return batch
