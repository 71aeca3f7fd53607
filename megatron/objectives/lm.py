"""Language modelling and label-masked SFT (``train_impl: normal``).

Inputs are the first ``seq_length`` tokens of ``text``, targets the shifted ``label`` array when the
sample has one (SFT: -100 on prompts, user turns and template markup) or the shifted text. With
``eod_mask_loss`` predictions of the end-of-document token are not counted either.

The loss is the mean cross-entropy over the counted tokens of the whole global batch (see
``base.py``): every counted token weighs the same, wherever it sits and however many of its
micro-batch's tokens are masked; the same number on every parallel layout. ``z_loss > 0`` adds
PaLM's auxiliary ``z_loss * (log Z)^2`` per counted token (``Z`` the softmax normaliser), which keeps
the output logits from drifting; it is reported as ``train/z_loss``.

With ``reset_attention_mask`` / ``reset_position_ids`` the documents of a packed sample (each ending
with the end-of-document token) are kept apart: the micro-batch carries each token's document and/or
its position within that document (``megatron/model/documents.py``), so each document gets the loss
and gradients it would get alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from megatron.errors import DataError
from megatron.model.documents import document_ids_from_eod, positions_in_documents
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy_and_log_z
from megatron.mpu.half_cross_entropy import vocab_parallel_cross_entropy_in_logits_dtype
from megatron.objectives.base import MicroBatch, Objective, Stats, count, shifted


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0,
                in_logits_dtype: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies + z-loss terms, sum of the z-loss terms) over counted tokens.

    ``logits`` ``[n, s, v/tp]``, ``labels`` ``[n, s]`` with -100 where nothing is counted.
    ``in_logits_dtype`` (``fp16_lm_cross_entropy``): each token's cross-entropy in the logits' dtype
    (fp16), as GPT-NeoX's ``cross_entropy(_fp16=True)``; the sum over tokens is then taken in fp32.
    """
    if in_logits_dtype:
        half = vocab_parallel_cross_entropy_in_logits_dtype(logits, labels)  # [n, s], logits' dtype
        total = (half.float() * (labels >= 0).float()).sum()
        return total, torch.zeros((), dtype=total.dtype, device=total.device)
    # log Z comes from the cross-entropy's own chunked pass: no fp32 copy of the logits for the z-loss
    losses, log_z = vocab_parallel_cross_entropy_and_log_z(logits, labels)  # [n, s] fp32 each
    counted = (labels >= 0).float()
    total = (losses * counted).sum()
    z_term = torch.zeros((), dtype=total.dtype, device=total.device)
    if z_loss > 0:
        z_term = z_loss * (log_z.square() * counted).sum()
        total = total + z_term
    return total, z_term


class LMObjective(Objective):
    train_impl = "normal"

    @property
    def metric_names(self) -> tuple[str, ...]:  # type: ignore[override]  # a ClassVar elsewhere, per-config here
        return ("z_loss",) if self.config.z_loss > 0 else ()

    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        tokens, labels = shifted(sample, "text", "label", self.eod_token)
        batch = MicroBatch(tokens, labels, units=float((labels >= 0).sum()))
        if not (self.config.reset_attention_mask or self.config.reset_position_ids):
            return batch
        if self.document_end_token is None:
            raise DataError("reset_attention_mask / reset_position_ids need the tokenizer's end-of-document token")
        documents = document_ids_from_eod(tokens, self.document_end_token)  # [b, s]
        return replace(batch, document_ids=documents if self.config.reset_attention_mask else None,
                       position_ids=positions_in_documents(documents) if self.config.reset_position_ids else None)

    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        total, z_term = lm_loss_sum(output, labels, self.config.z_loss, self.fp16_cross_entropy)
        stats: Stats = {}
        if self.config.z_loss > 0:
            stats["z_loss"] = (z_term.detach(), count((labels >= 0).sum()))
        return total, stats
