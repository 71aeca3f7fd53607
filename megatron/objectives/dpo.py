"""Direct Preference Optimization (``train_impl: dpo``; Rafailov et al. 2023).

A micro-batch of ``m`` preference pairs is run as one model batch of ``2m`` rows, the chosen responses
first and the rejected ones after them, so one forward (and, under pipeline parallelism, one pass
through the stages) sees both sides of every pair and the last stage can form the loss. Per pair,
with summed log-probabilities of the counted (label != -100) tokens::

    loss = -log sigmoid(beta * ((log pi_c - log pi_r) - (log ref_c - log ref_r)))

``ref`` comes from a frozen copy of the starting weights, from precomputed log-probs, or is 0
(``dpo_reference_free``). The step's loss is the mean over the pairs of the global batch. Metrics,
as TRL names them: ``rewards/chosen`` and ``rewards/rejected`` (``beta * (log pi - log ref)``),
``rewards/accuracy`` (share of pairs whose chosen reward is higher), ``rewards/margin`` (mean
difference), and ``logps/chosen``/``logps/rejected``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F

from megatron.objectives.base import IGNORE_INDEX, MicroBatch, Objective, Stats, count, shifted
from megatron.objectives.logprobs import sequence_logps
from megatron.objectives.config import DPOKeys


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the (detached) implicit rewards of the chosen and rejected responses."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * logits)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def pair_rows(sample: Mapping[str, torch.Tensor], eod_token: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2m, s]`` inputs and labels: the chosen rows, then the rejected rows."""
    chosen_tokens, chosen_labels = shifted(sample, "chosen", "chosen_label", eod_token)
    rejected_tokens, rejected_labels = shifted(sample, "rejected", "rejected_label", eod_token)
    return torch.cat([chosen_tokens, rejected_tokens]), torch.cat([chosen_labels, rejected_labels])


class DPOObjective(Objective):
    train_impl = "dpo"
    uses_reference = True
    rows_per_sample = 2
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                    "logps/chosen", "logps/rejected")

    @property
    def keys(self) -> DPOKeys:
        """DPO's own keys: the arguments object, composed of :class:`DPOKeys` (``build_objective`` checks it)."""
        return cast(DPOKeys, self.config)

    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        tokens, labels = pair_rows(sample, self.eod_token)
        reference = None
        if "chosen_ref" in sample:
            # precomputed per-token values (value[t] = log ref(token t | tokens < t)), shifted like the
            # labels: the sum over the counted targets is the reference's sequence log-prob
            values = torch.cat([sample["chosen_ref"], sample["rejected_ref"]]).float()[:, 1:]  # [2m, s]
            reference = torch.where(labels != IGNORE_INDEX, values, torch.zeros_like(values)).sum(dim=1)  # [2m]
        return MicroBatch(tokens, labels, units=float(tokens.shape[0] // 2), reference=reference)

    def reference_logps(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sequence_logps(output, labels, self.keys.dpo_fp32)

    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        cfg = self.keys
        logps = sequence_logps(output, labels, cfg.dpo_fp32)  # [2m]
        if cfg.dpo_fp32:
            logps, reference = logps.float(), reference.float()
        else:
            reference = reference.to(logps.dtype)
        policy_chosen, policy_rejected = logps.chunk(2)
        ref_chosen, ref_rejected = reference.chunk(2)
        losses, chosen_rewards, rejected_rewards = dpo_losses(policy_chosen, policy_rejected, ref_chosen,
                                                              ref_rejected, cfg.dpo_beta)
        pairs = count(losses.shape[0])
        stats: Stats = {
            "rewards/chosen": (chosen_rewards.sum(), pairs),
            "rewards/rejected": (rejected_rewards.sum(), pairs),
            "rewards/accuracy": ((chosen_rewards > rejected_rewards).float().sum(), pairs),
            "rewards/margin": ((chosen_rewards - rejected_rewards).sum(), pairs),
            "logps/chosen": (policy_chosen.detach().sum(), pairs),
            "logps/rejected": (policy_rejected.detach().sum(), pairs),
        }
        return losses.sum(), stats
