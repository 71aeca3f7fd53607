"""Deepy's objectives as plug-ins: what the objectives layer attaches to each ``train_impl`` name.

The names and needs (dataset kind, a value head, a reference, packed documents) are declared below every
component, in :mod:`megatron.objective_needs`, so the data config and the checkpoints read them without this
package; here each gets its keys (``config.py``), its checks and its implementation. The implementations
(``lm.py``, ``dpo.py``, ...) are named, not imported, so that the launcher composes the keys and runs the
checks without torch or DeepSpeed; :func:`build_objective` imports the one a rank builds. A plug-in
objective of a user's (``plugins:``) registers whole in one file, with :func:`megatron.plugins.register` on
its class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron import plugins
from megatron.objectives.config import DPOKeys, KTOKeys, ObjectiveArgs, reference_kind

if TYPE_CHECKING:
    from megatron.objectives.base import Objective


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


plugins.attach("train_impl", "normal", target="megatron.objectives.lm:LMObjective")
plugins.attach("train_impl", "dpo", target="megatron.objectives.dpo:DPOObjective", keys=DPOKeys, check=_dpo_check)
plugins.attach("train_impl", "kto", target="megatron.objectives.kto:KTOObjective", keys=KTOKeys)
plugins.attach("train_impl", "rm", target="megatron.objectives.rm:RewardModelObjective", check=_rm_check)
plugins.attach("train_impl", "reinforce", target="megatron.objectives.reinforce:ReinforceObjective")


def build_objective(config: ObjectiveArgs, eod_token: int | None = None) -> Objective:
    """The objective ``config.train_impl`` names, reading its keys from ``config`` (the arguments object,
    composed of :class:`ObjectiveArgs` and the plug-in's own keys); ``eod_token`` is used when
    ``eod_mask_loss`` is on."""
    plugin = plugins.get("train_impl", config.train_impl)
    if plugin.keys is not None and not isinstance(config, plugin.keys):
        raise TypeError(f"train_impl {config.train_impl!r} reads its own keys ({plugin.keys.__name__}) from the "
                        f"arguments object: pass NeoXArgs (or the schema_class() with a user's plug-ins), not "
                        f"{type(config).__name__}")
    objective: Objective = plugin.resolve()(config, eod_token)
    return objective
