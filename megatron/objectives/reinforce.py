"""GPT-NeoX's online REINFORCE (``train_impl: reinforce``; megatron/training.py:796-860 @ea7aefd8), on the rollouts
of ``dataset_impl: online`` (``megatron/data/online_dataset.py``, which subtracts the baseline from the rewards).

With ``logp_t = log pi(y_t)`` of each counted completion token (``fp32_reinforce``: the log-softmax of the logits
cast to fp32), ``A`` the sample's baselined reward and ``m_t`` 1 on counted tokens, 0 elsewhere::

    l_t  = -logp_t * A + kl_div_beta * kl_t          (no KL term without a reference: kl_div_beta <= 0)
    loss = mean_over_rows( sum_t l_t * m_t ) / sum_{rows, t} m_t

per micro-batch: GPT-NeoX divides each row's sum by the micro-batch's counted tokens and then takes the mean over
the rows, so the per-token mean is divided once more by the rows of the micro-batch (kept: it is GPT-NeoX's scale
of the loss and of the gradient). The step's loss is the mean of its micro-batches' (DeepSpeed's accumulation and
data-parallel mean): each micro-batch counts as one loss unit.

``kl_t`` against the reference (a frozen copy of the starting weights, ``reference.py``), with
``d_t = logp_t - ref_logp_t``: ``abs`` |d_t|, ``mse`` d_t^2 / 2, ``kl`` d_t, ``full`` the KL of the whole next-token
distributions, ``sum_v pi_v (log pi_v - log ref_v)`` (``F.kl_div(ref, logp, log_target=True)``). Metrics: ``reward``
(the raw rewards' mean over the samples), ``logp``, ``ref_logp`` and ``kl`` (means over counted tokens; GPT-NeoX
averages every position, padding included).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from megatron.errors import DataError
from megatron.mpu.mappings import gather_from_tensor_model_parallel_region
from megatron.objectives.base import IGNORE_INDEX, MicroBatch, Objective, Stats, count, shifted


def log_softmax(logits: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``[n, s, v]`` next-token log-probabilities of this rank's ``[n, s, v/tp]`` vocab-parallel logits, in fp32 or
    in the logits' precision (GPT-NeoX's ``get_logp``). The logits are gathered over the tensor-parallel ranks first,
    as GPT-NeoX does for ``kl_impl: full`` (training.py:811,822 @ea7aefd8; its other kl_impls take the log-softmax of
    the local vocabulary slice, which at tp > 1 is not a distribution); the backward keeps this rank's slice."""
    full = gather_from_tensor_model_parallel_region(logits)  # [n, s, v]; itself at tp 1
    return (full.float() if fp32 else full).log_softmax(dim=-1)


def gathered(logp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[n, s]`` log-probability of each label (uncounted positions, -100, read token 0 and are masked later)."""
    return torch.gather(logp, dim=2, index=labels.clamp(min=0).unsqueeze(2)).squeeze(2)


def kl_penalty(kl_impl: str, logp: torch.Tensor, per_token: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[n, s]`` KL estimate; ``reference`` is ``[n, s, v]`` log-probabilities for ``full``, else ``[n, s]``."""
    if kl_impl == "full":
        return F.kl_div(reference, logp, log_target=True, reduction="none").sum(-1)
    d = per_token - reference
    if kl_impl == "abs":
        return d.abs()
    if kl_impl == "mse":
        return 0.5 * d.square()
    return d  # kl


def reinforce_loss(per_token: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
                   kl: torch.Tensor | None, beta: float) -> torch.Tensor:
    """GPT-NeoX's micro-batch loss (module docstring); ``rewards`` ``[n, 1]``, ``mask`` ``[n, s]``."""
    per_token_loss = -per_token * rewards if kl is None else -per_token * rewards + beta * kl
    return ((per_token_loss * mask).sum(-1) / mask.sum().clamp(min=1)).mean()


class ReinforceObjective(Objective):
    train_impl = "reinforce"
    uses_reference = True
    metric_names = ("reward", "logp", "ref_logp", "kl")

    @property
    def with_reference(self) -> bool:
        """GPT-NeoX builds the reference model, and adds the KL term, only with ``kl_div_beta > 0``."""
        return self.config.kl_div_beta > 0

    def prepare(self, sample: Mapping[str, torch.Tensor]) -> MicroBatch:
        missing = [key for key in ("text", "label", "reward", "raw_reward") if key not in sample]
        if missing:
            raise DataError(f"train_impl reinforce reads rollouts (text, label, reward, raw_reward); {missing} missing: "
                            "set dataset_impl: online")
        tokens, labels = shifted(sample, "text", "label", self.eod_token)
        rows = tokens.shape[0]
        extras = (sample["reward"].float().reshape(rows, 1), sample["raw_reward"].float().reshape(rows, 1))
        return MicroBatch(tokens, labels, extras=extras, units=1.0)  # GPT-NeoX normalises each micro-batch alone

    def reference_logps(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp = log_softmax(output, self.config.fp32_reinforce)
        return logp if self.config.kl_impl == "full" else gathered(logp, labels)

    def loss_sum(self, output: torch.Tensor, labels: torch.Tensor, extras: tuple[torch.Tensor, ...],
                 reference: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        cfg = self.config
        rewards, raw_rewards = extras
        logp = log_softmax(output, cfg.fp32_reinforce)
        per_token = gathered(logp, labels)
        mask = (labels != IGNORE_INDEX).float()
        tokens = count(mask.sum())
        stats: Stats = {"reward": (raw_rewards.detach().sum(), count(raw_rewards.numel())),
                        "logp": ((per_token.detach() * mask).sum(), tokens)}
        kl = None
        if self.with_reference:
            reference = reference.to(logp.dtype)
            kl = kl_penalty(cfg.kl_impl, logp, per_token, reference)
            ref_per_token = gathered(reference, labels) if cfg.kl_impl == "full" else reference
            stats["ref_logp"] = ((ref_per_token.detach() * mask).sum(), tokens)
            stats["kl"] = ((kl.detach() * mask).sum(), tokens)
        return reinforce_loss(per_token, rewards, mask, kl, cfg.kl_div_beta), stats  # fp32 rewards, as GPT-NeoX reads them
