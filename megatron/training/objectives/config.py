"""The objective's frozen config: ``train_impl``, the keys several objectives share, and the selected
objective plug-in's own keys (``keys``: the arguments object itself in training, typed as the class the
plug-in declares).

The shared keys are still copied here from the schema (``megatron/neox_arguments/groups/training.py``
and ``other.py``); ``tests/unit/test_keys_declared_once.py`` lists this class among those left to convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron import plugins

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs

TrainImpl = str
"""A registered objective plug-in's name (``megatron/training/objectives/registry.py``)."""
ReferenceKind = Literal["none", "frozen_copy", "precomputed", "free"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    train_impl: TrainImpl = "normal"
    """Which loss: a registered objective plug-in (language modelling/SFT, DPO, KTO, a reward model, ...)."""
    eod_mask_loss: bool = False
    """Predictions of the end-of-document token carry no loss (token-level objectives)."""
    reset_attention_mask: bool = False
    """Language modelling: documents of a packed sample attend only within themselves."""
    reset_position_ids: bool = False
    """Language modelling: positions restart at 0 at each document of a packed sample."""
    z_loss: float = 0.0
    """LM: weight of mean (log Z)^2 over counted tokens; RM: weight of mean(s_c^2 + s_r^2)."""
    reference_logps: str | None = None
    """DPO: the ``precompute_model_name`` whose log-probs ``generate.py`` wrote next to each dataset
    (``<prefix>_<name>.bin/.idx``); None = a frozen copy of the starting weights."""
    keys: Any = None
    """The objective plug-in's own keys (``dpo_beta``, ``kto_fp32``, ...): an instance of the class it
    declares — in training the arguments object itself, which is composed of that class; None for
    an objective that declares none."""

    def __post_init__(self) -> None:
        declared = plugins.get("train_impl", self.train_impl).keys
        if self.keys is None and declared is not None:
            object.__setattr__(self, "keys", declared())  # the plug-in's defaults

    @classmethod
    def of(cls, train_impl: str = "normal", **values: Any) -> ObjectiveConfig:
        """From key names directly (tools and tests): the plug-in's own keys go into ``keys``."""
        declared = plugins.get("train_impl", train_impl).keys
        own = {key: values.pop(key) for key in list(values) if declared is not None and key in declared.model_fields}
        return cls(train_impl=train_impl, keys=declared(**own) if declared is not None else None, **values)

    @classmethod
    def from_args(cls, args: "NeoXArgs") -> ObjectiveConfig:
        declared = plugins.get("train_impl", args.train_impl).keys
        return cls(
            train_impl=args.train_impl,
            eod_mask_loss=args.eod_mask_loss,
            reset_attention_mask=args.reset_attention_mask,
            reset_position_ids=args.reset_position_ids,
            z_loss=args.z_loss,
            reference_logps=args.reference_logps,
            keys=args if declared is not None else None,
        )

    @property
    def reference(self) -> ReferenceKind:
        """Where the reference log-probs come from (``none`` for objectives without a reference)."""
        from megatron.training.objectives.registry import needs_of

        if not needs_of(self.train_impl).reference:
            return "none"
        if self.train_impl == "dpo" and self.keys.dpo_reference_free:
            return "free"
        return "precomputed" if self.reference_logps else "frozen_copy"
