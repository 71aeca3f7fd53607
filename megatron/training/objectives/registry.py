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
from typing import Protocol

from pydantic import Field

from megatron import plugins
from megatron.config_schema import ArgGroup


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


class _DPOCheckArgs(Protocol):
    """The keys DPO's check reads (its own and the shared ``reference_logps``)."""

    @property
    def dpo_reference_free(self) -> bool: ...
    @property
    def reference_logps(self) -> str | None: ...


class _RMCheckArgs(Protocol):
    @property
    def eod_mask_loss(self) -> bool: ...


class _KTOCheckArgs(Protocol):
    @property
    def train_micro_batch_size_per_gpu(self) -> int | None: ...


def _dpo_check(args: _DPOCheckArgs, show: Callable[[str], str]) -> list[str]:
    if args.dpo_reference_free and args.reference_logps:
        return [f"{show('dpo_reference_free')} and {show('reference_logps')} contradict each other: "
                "reference-free DPO reads no reference log-probs; keep one"]
    return []


def _rm_check(args: _RMCheckArgs, show: Callable[[str], str]) -> list[str]:
    if args.eod_mask_loss:
        return [f"{show('eod_mask_loss')} has no effect on a reward model (it scores whole responses; no "
                "token carries a loss): remove it"]
    return []


def _kto_check(args: _KTOCheckArgs, show: Callable[[str], str]) -> list[str]:
    micro = args.train_micro_batch_size_per_gpu
    if isinstance(micro, int) and micro < 2:
        return [f"{show('train_micro_batch_size_per_gpu')} with train_impl: kto: KTO estimates its KL reference "
                "point from mismatched pairs inside a micro-batch, which needs at least 2 samples; raise it to 2 "
                "or more"]
    return []


plugins.declare("train_impl", "normal", "megatron.training.objectives.lm:LMObjective", documents=True)
plugins.declare("train_impl", "dpo", "megatron.training.objectives.dpo:DPOObjective",
                keys=DPOKeys, check=_dpo_check, dataset="pairwise", reference=True)
plugins.declare("train_impl", "kto", "megatron.training.objectives.kto:KTOObjective",
                keys=KTOKeys, check=_kto_check, dataset="reward", reference=True)
plugins.declare("train_impl", "rm", "megatron.training.objectives.rm:RewardModelObjective",
                check=_rm_check, dataset="pairwise", value_head=True)

NOT_BUILT: tuple[str, ...] = ("reinforce",)
"""GPT-NeoX's ``train_impl`` values Deepy has not built: accepted by the schema, refused as "not
supported yet" before launch."""
