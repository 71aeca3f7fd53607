"""The objective's own frozen config, read once from the user's arguments.

Every default lives in the schema (``megatron/neox_arguments/groups/training.py`` and ``other.py``);
this class only copies the keys the objectives read, so the rest of the package never touches the
argument object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs

TrainImpl = Literal["normal", "dpo", "kto", "rm"]
ReferenceKind = Literal["none", "frozen_copy", "precomputed", "free"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    train_impl: TrainImpl = "normal"
    """Which loss: language modelling/SFT, DPO, KTO or a pairwise reward model."""
    eod_mask_loss: bool = False
    """Predictions of the end-of-document token carry no loss (token-level objectives)."""
    reset_attention_mask: bool = False
    """Language modelling: documents of a packed sample attend only within themselves."""
    reset_position_ids: bool = False
    """Language modelling: positions restart at 0 at each document of a packed sample."""
    z_loss: float = 0.0
    """LM: weight of mean (log Z)^2 over counted tokens; RM: weight of mean(s_c^2 + s_r^2)."""
    dpo_beta: float = 0.1
    dpo_fp32: bool = True
    dpo_reference_free: bool = False
    kto_beta: float = 0.1
    kto_fp32: bool = True
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    reference_logps: str | None = None
    """DPO: the ``precompute_model_name`` whose log-probs ``generate.py`` wrote next to each dataset
    (``<prefix>_<name>.bin/.idx``); None = a frozen copy of the starting weights."""
    # where the starting weights (the frozen reference) come from
    load: str | None = None
    finetune: bool = False
    initialize_from: str | None = None
    iteration: int | None = None

    @classmethod
    def from_args(cls, args: "NeoXArgs") -> ObjectiveConfig:
        return cls(
            train_impl=args.train_impl,
            eod_mask_loss=args.eod_mask_loss,
            reset_attention_mask=args.reset_attention_mask,
            reset_position_ids=args.reset_position_ids,
            z_loss=args.z_loss,
            dpo_beta=args.dpo_beta,
            dpo_fp32=args.dpo_fp32,
            dpo_reference_free=args.dpo_reference_free,
            kto_beta=args.kto_beta,
            kto_fp32=args.kto_fp32,
            kto_desirable_weight=args.kto_desirable_weight,
            kto_undesirable_weight=args.kto_undesirable_weight,
            reference_logps=args.reference_logps,
            load=args.load,
            finetune=args.finetune,
            initialize_from=args.initialize_from,
            iteration=args.iteration,
        )

    @property
    def reference(self) -> ReferenceKind:
        """Where the reference log-probs come from (``none`` for objectives without a reference)."""
        if self.train_impl not in ("dpo", "kto"):
            return "none"
        if self.train_impl == "dpo" and self.dpo_reference_free:
            return "free"
        return "precomputed" if self.reference_logps else "frozen_copy"
