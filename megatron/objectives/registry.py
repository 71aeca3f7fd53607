"""Deepy's objectives as plug-ins: each ``train_impl`` with its own keys, checks and needs.

Declared here, in a module that imports neither torch nor DeepSpeed, so ``deepy.py`` validates a
config without them; the implementations (``lm.py``, ``dpo.py``, ...) are imported when a rank builds
the objective. A plug-in objective of a user's (``plugins:``) registers the same way in one file, with
:func:`megatron.plugins.register` on its class.

The ``needs`` of an objective (its dataset kind, a value head, a reference, packed documents) are read
through :mod:`megatron.objective_needs`, below every component, so the data config reads them without
importing the training package.
"""

from __future__ import annotations

from collections.abc import Callable
from pydantic import Field

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.objective_needs import needs_of
from megatron.objectives.config import ObjectiveArgs, ReferenceKind


class DPOKeys(ArgGroup):
    """Keys of direct preference optimisation (``train_impl: dpo``)."""

    dpo_fp32: bool = True
    """Sum DPO log-probabilities in fp32; false sums them in the model's precision."""

    dpo_reference_free: bool = False
    """Run DPO without a reference model (the reference log-probs are taken as zero)."""

    dpo_beta: float = Field(0.1, gt=0)
    """DPO temperature: how strongly the policy may move away from the reference."""


class KTOKeys(ArgGroup):
    """Keys of Kahneman-Tversky optimisation (``train_impl: kto``)."""

    kto_fp32: bool = True
    """Sum KTO log-probabilities in fp32; false sums them in the model's precision."""

    kto_desirable_weight: float = Field(1.0, ge=0)
    """KTO loss weight of desirable examples (reward > 0)."""

    kto_undesirable_weight: float = Field(1.0, ge=0)
    """KTO loss weight of undesirable examples (reward <= 0)."""

    kto_beta: float = Field(0.1, gt=0)
    """KTO temperature, as dpo_beta is for DPO."""


def reference_kind(config: ObjectiveArgs) -> ReferenceKind:
    """Where the objective's reference log-probs come from: ``none`` for an objective without a reference,
    ``free`` for reference-free DPO, ``precomputed`` files (``reference_logps``) or a ``frozen_copy`` of the
    starting weights. ``config`` is the arguments object, composed of :class:`DPOKeys` too (a bare
    ``ObjectiveArgs`` holds no DPO key, so it is never reference-free)."""
    if not needs_of(config.train_impl).reference:
        return "none"
    if config.train_impl == "dpo" and isinstance(config, DPOKeys) and config.dpo_reference_free:
        return "free"
    return "precomputed" if config.reference_logps else "frozen_copy"


def _dpo_check(args: ObjectiveArgs, show: Callable[[str], str]) -> list[str]:
    if reference_kind(args) == "free" and args.reference_logps:  # free: dpo_reference_free is set
        return [f"{show('dpo_reference_free')} and {show('reference_logps')} contradict each other: "
                "reference-free DPO reads no reference log-probs; keep one"]
    return []


def _rm_check(args: ObjectiveArgs, show: Callable[[str], str]) -> list[str]:
    if args.eod_mask_loss:
        return [f"{show('eod_mask_loss')} has no effect on a reward model (it scores whole responses; no "
                "token carries a loss): remove it"]
    return []


plugins.declare("train_impl", "normal", "megatron.objectives.lm:LMObjective", documents=True)
plugins.declare("train_impl", "dpo", "megatron.objectives.dpo:DPOObjective",
                keys=DPOKeys, check=_dpo_check, dataset="pairwise", reference=True)
# KTO estimates its KL reference point from mismatched pairs inside a micro-batch: at least 2 samples
plugins.declare("train_impl", "kto", "megatron.objectives.kto:KTOObjective",
                keys=KTOKeys, dataset="reward", reference=True, min_micro_batch=2)
plugins.declare("train_impl", "rm", "megatron.objectives.rm:RewardModelObjective",
                check=_rm_check, dataset="pairwise", value_head=True)
