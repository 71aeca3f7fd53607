"""Pairwise reward model (``train_impl: rm``).

The model ends in a scalar value head instead of the LM head (``GPTConfig.value_head``, set for
``train_impl: rm``; the head is a model parameter, so checkpoints keep it). Like DPO, a micro-batch of
``m`` pairs runs as ``2m`` rows, chosen first. A response's score is the head's value at its last
counted token inside the input window (the end of the completion, after which the model has read the
whole response; a row with no counted token uses its last position). Per pair::

    loss = -log sigmoid(s_chosen - s_rejected) + z_loss * (s_chosen^2 + s_rejected^2)

the second term being GPT-NeoX's ``z_loss`` for reward models, which keeps scores near zero (the
pairwise loss only fixes their differences). The step's loss is the mean over the pairs of the
global batch. Metrics: ``rm/accuracy`` (share of pairs scored the right way round), ``rm/margin``
(mean ``s_chosen - s_rejected``), ``rm/chosen`` and ``rm/rejected`` (mean scores).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from megatron.errors import DataError
from megatron.objectives.base import IGNORE_INDEX, MicroBatch, Objective, Stats, count
from megatron.objectives.dpo import pair_rows


def rm_losses(chosen: torch.Tensor, rejected: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Per-pair loss from the scores of the chosen and rejected responses."""
    losses = -F.logsigmoid(chosen - rejected)
    if z_loss > 0:
        losses = losses + z_loss * (chosen.square() + rejected.square())
    return losses


def score_positions(label: torch.Tensor, seq_length: int) -> torch.Tensor:
    """``[n]`` index of each row's last counted token among the first ``seq_length`` (the inputs)."""
    counted = label[:, :seq_length] != IGNORE_INDEX
    positions = torch.arange(counted.shape[1]).expand_as(counted)
    last = torch.where(counted, positions, -1).max(dim=1).values
    return torch.where(last >= 0, last, torch.full_like(last, seq_length - 1))


class RewardModelObjective(Objective):
    train_impl = "rm"
    value_head = True
    new_parameters = ("value_head.",)  # SFT -> RM: the scalar head is new, the rest is the LM's
    rows_per_sample = 2
    metric_names = ("rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected")

    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        if "chosen_label" not in sample or "rejected_label" not in sample:
            raise DataError(f"train_impl rm needs preference pairs (chosen/rejected); got keys {sorted(sample)}")
        tokens, labels = pair_rows(sample, None)
        seq = tokens.shape[1]
        index = torch.cat([score_positions(sample["chosen_label"].long(), seq),
                           score_positions(sample["rejected_label"].long(), seq)])
        return MicroBatch(tokens, labels, extras=(index,), units=float(tokens.shape[0] // 2))

    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        index = extras[0].long()
        scores = output[torch.arange(output.shape[0], device=output.device), index, 0].float()  # [2m]
        chosen, rejected = scores.chunk(2)
        losses = rm_losses(chosen, rejected, self.config.z_loss)
        pairs = count(losses.shape[0])
        c, r = chosen.detach(), rejected.detach()
        stats: Stats = {
            "rm/accuracy": ((c > r).float().sum(), pairs),
            "rm/margin": ((c - r).sum(), pairs),
            "rm/chosen": (c.sum(), pairs),
            "rm/rejected": (r.sum(), pairs),
        }
        return losses.sum(), stats
