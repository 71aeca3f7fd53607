"""Training objectives, one module per ``train_impl``: ``lm`` (language modelling and label-masked
SFT), ``dpo``, ``kto``, ``rm`` (pairwise reward model) and ``reinforce`` (GPT-NeoX's online REINFORCE), plus where DPO's and KTO's reference
log-probs come from (``reference``, ``frozen``). How a global batch of any of them runs through a plain
or pipelined engine is the trainer's (``megatron/training/objective_runner.py``).

Objectives are plug-ins (``megatron/objective_needs.py`` declares Deepy's names and needs, ``registry.py``
attaches their keys, checks and classes; a user's registers with :func:`megatron.plugins.register`):
``build_objective`` builds the one ``train_impl`` names. The loss
math lives in pure functions (``lm_loss_sum``, ``dpo_losses``, ``kto_losses``, ``rm_losses``).

A package of its own, one layer below the engine (``megatron/engine/``) rather than inside it: the
engine builds a pipeline's loss and a reward model's head from an objective, training runs every
objective and generation builds its model with the plain language-modelling one, while an objective needs
nothing of the engine (only the model, the parallel groups, the data's batches and, for a frozen
reference, a checkpoint). Below the engine, both the engine and the layers above it may import it and
nothing here can import them back (``tests/unit/test_import_graph.py``: ``LAYERS``).

The names below are imported on first use, not with the package, so that the launcher can read the
registry without importing torch's training stack and DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron.objectives.base import MicroBatch, Objective  # noqa: F401
    from megatron.objectives.config import ObjectiveArgs  # noqa: F401
    from megatron.objectives.dpo import DPOObjective, dpo_losses  # noqa: F401
    from megatron.objectives.kto import KTOObjective, kto_losses  # noqa: F401
    from megatron.objectives.lm import LMObjective, lm_loss_sum  # noqa: F401
    from megatron.objectives.reference import Reference, build_reference  # noqa: F401
    from megatron.objectives.registry import build_objective  # noqa: F401
    from megatron.objectives.rm import RewardModelObjective, rm_losses  # noqa: F401

_EXPORTS = {
    "MicroBatch": "base", "Objective": "base", "ObjectiveArgs": "config",
    "DPOObjective": "dpo", "dpo_losses": "dpo", "KTOObjective": "kto", "kto_losses": "kto",
    "LMObjective": "lm", "lm_loss_sum": "lm", "Reference": "reference", "build_reference": "reference",
    "RewardModelObjective": "rm", "rm_losses": "rm", "build_objective": "registry",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = [*_EXPORTS]
