"""The language-modelling loss on vocab-parallel logits."""

from __future__ import annotations

import torch

from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token loss over the counted tokens.

    `logits` `[b, s, v/tp]` (this rank's vocabulary shard), `labels` `[b, s]` (negative = not
    counted, e.g. -100), `loss_mask` `[b, s]` optional 0/1 weights. The same value on every tp rank.
    """
    losses = vocab_parallel_cross_entropy(logits, labels)  # [b, s], fp32
    mask = (labels >= 0).float()
    if loss_mask is not None:
        mask = mask * loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)

