"""Kahneman-Tversky Optimization (``train_impl: kto``; Ethayarajh et al. 2024).

Samples are single completions with a per-document reward: > 0 marks a desirable completion,
<= 0 an undesirable one (KTO is binary: only the sign is read). With ``r = log pi(y|x) - log ref(y|x)``
summed over the completion's counted tokens::

    desirable:    kto_desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable:  kto_undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

The reference point ``z0`` estimates KL(pi || ref) from *mismatched* pairs inside each micro-batch,
as in the paper and TRL's ``KTOTrainer``: sample ``i``'s prompt with the completion of sample
``i - 1`` (cyclically), ``z0 = max(0, mean_i(log pi - log ref))`` over those pairs, detached. The
mismatched rows ride in the same model batch as the real ones (``2m`` rows: real first), so the
pipeline's last stage sees all of them. The estimate is per micro-batch, not gathered over
data-parallel ranks as TRL does, so it is the same on every layout; it needs micro-batches of at
least 2 samples (a config rule says so). The step's loss is the mean over the samples of the global
batch. Metrics: ``rewards/desirable``, ``rewards/undesirable`` (means of ``beta * r``),
``rewards/margin`` (their difference), ``kl`` (mean ``z0`` over micro-batches).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from megatron.errors import DataError
from megatron.objectives.base import IGNORE_INDEX, MicroBatch, Objective, Stats, count, shifted
from megatron.objectives.logprobs import sequence_logps
from megatron.objectives.config import KTOKeys


def kto_losses(policy: torch.Tensor, policy_kl: torch.Tensor, ref: torch.Tensor, ref_kl: torch.Tensor,
               desirable: torch.Tensor, beta: float, desirable_weight: float,
               undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample weighted losses, the (detached) rewards ``beta * r`` and the reference point ``z0``."""
    z0 = (policy_kl - ref_kl).mean().detach().clamp(min=0)
    logratio = policy - ref
    gain = desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0)))
    pain = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio)))
    return torch.where(desirable, gain, pain), beta * logratio.detach(), z0


def mismatched_rows(text: torch.Tensor, label: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``: the prompt of sample ``i`` followed by the completion of sample ``i - 1`` (cyclic).

    ``text``/``label`` ``[m, L]`` unshifted (``label[t]`` is the target at ``t``, -100 = not counted).
    A sample's prompt is everything before its first counted token, its completion the span from the
    first to the last counted token (labels kept, so masked markup inside stays masked). Rows are cut
    or padded to ``L`` (padding is never counted and, coming last, never seen by earlier tokens).
    """
    m, length = text.shape
    counted = label != IGNORE_INDEX
    any_counted = counted.any(dim=1)
    positions = torch.arange(length)
    first = torch.where(any_counted, torch.where(counted, positions, length).min(dim=1).values, length)
    last = torch.where(any_counted, torch.where(counted, positions, -1).max(dim=1).values, length - 1)
    out_text = torch.full_like(text, pad_id)
    out_label = torch.full_like(label, IGNORE_INDEX)
    for i in range(m):
        j = (i - 1) % m
        prompt = text[i, : first[i]]
        completion, completion_label = text[j, first[j] : last[j] + 1], label[j, first[j] : last[j] + 1]
        row = torch.cat([prompt, completion])[:length]
        row_label = torch.cat([torch.full_like(prompt, IGNORE_INDEX), completion_label])[:length]
        out_text[i, : len(row)] = row
        out_label[i, : len(row_label)] = row_label
    return out_text, out_label


class KTOObjective(Objective):
    train_impl = "kto"
    uses_reference = True
    rows_per_sample = 2
    metric_names = ("rewards/desirable", "rewards/undesirable", "kl", "logps/desirable", "logps/undesirable")

    @property
    def keys(self) -> KTOKeys:
        """KTO's own keys: the arguments object, composed of :class:`KTOKeys` (``build_objective`` checks it)."""
        return cast(KTOKeys, self.config)

    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        missing = [key for key in ("text", "label", "reward") if key not in sample]
        if missing:
            raise DataError(f"train_impl kto needs text, label and reward in every sample; {missing} missing "
                            "(set train_reward_data_paths next to train_data_paths)")
        kl_text, kl_label = mismatched_rows(sample["text"].long(), sample["label"].long())
        tokens, labels = shifted(sample, "text", "label", self.eod_token)
        kl_tokens, kl_labels = shifted({"text": kl_text, "label": kl_label}, "text", "label", self.eod_token)
        reward = sample["reward"].float().reshape(-1)
        return MicroBatch(torch.cat([tokens, kl_tokens]), torch.cat([labels, kl_labels]), extras=(reward,),
                          units=float(reward.shape[0]))

    def reference_logps(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sequence_logps(output, labels, self.keys.kto_fp32)

    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        cfg = self.keys
        logps = sequence_logps(output, labels, cfg.kto_fp32)  # [2m]: real rows, then mismatched rows
        reference = reference.float() if cfg.kto_fp32 else reference.to(logps.dtype)
        policy, policy_kl = logps.chunk(2)
        ref, ref_kl = reference.chunk(2)
        desirable = extras[0] > 0
        losses, rewards, z0 = kto_losses(policy, policy_kl, ref, ref_kl, desirable, cfg.kto_beta,
                                         cfg.kto_desirable_weight, cfg.kto_undesirable_weight)
        undesirable = ~desirable
        stats: Stats = {
            "rewards/desirable": ((rewards * desirable).sum(), count(desirable.sum())),
            "rewards/undesirable": ((rewards * undesirable).sum(), count(undesirable.sum())),
            "kl": (z0, count(1)),
            "logps/desirable": ((policy.detach() * desirable).sum(), count(desirable.sum())),
            "logps/undesirable": ((policy.detach() * undesirable).sum(), count(undesirable.sum())),
        }
        return losses.sum(), stats

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        if "rewards/desirable" in means and "rewards/undesirable" in means:
            means["rewards/margin"] = means["rewards/desirable"] - means["rewards/undesirable"]
        return means
