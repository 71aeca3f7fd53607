"""Training objectives, one module per ``train_impl``: ``lm`` (language modelling and label-masked
SFT), ``dpo``, ``kto`` and ``rm`` (pairwise reward model), plus where DPO's and KTO's reference
log-probs come from (``reference``, ``frozen``) and how a global batch of any of them
runs through a plain or pipelined engine (``run``).

``build_objective(ObjectiveConfig.from_args(args), eod_token)`` picks the objective from the registry;
the loss math lives in pure functions (``lm_loss_sum``, ``dpo_losses``, ``kto_losses``, ``rm_losses``).
"""

from __future__ import annotations

from megatron.training.objectives.base import MicroBatch, Objective
from megatron.training.objectives.config import ObjectiveConfig
from megatron.training.objectives.dpo import DPOObjective, dpo_losses
from megatron.training.objectives.kto import KTOObjective, kto_losses
from megatron.training.objectives.lm import LMObjective, lm_loss_sum
from megatron.training.objectives.reference import Reference, build_reference
from megatron.training.objectives.rm import RewardModelObjective, rm_losses
from megatron.training.objectives.run import ObjectiveRunner

OBJECTIVES: dict[str, type[Objective]] = {
    "normal": LMObjective,
    "dpo": DPOObjective,
    "kto": KTOObjective,
    "rm": RewardModelObjective,
}


def build_objective(config: ObjectiveConfig, eod_token: int | None = None) -> Objective:
    """The objective for ``config.train_impl``; ``eod_token`` is used when ``eod_mask_loss`` is on."""
    return OBJECTIVES[config.train_impl](config, eod_token)


__all__ = [
    "OBJECTIVES", "DPOObjective", "KTOObjective", "LMObjective", "MicroBatch", "Objective", "ObjectiveConfig",
    "ObjectiveRunner", "Reference", "RewardModelObjective", "build_objective", "build_reference", "dpo_losses",
    "kto_losses", "lm_loss_sum", "rm_losses",
]
