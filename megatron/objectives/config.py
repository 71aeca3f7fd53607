"""The training objective's keys: which objective (``train_impl``) and the keys several objectives
share (the z-loss, end-of-document masking, packed documents kept apart, DPO's precomputed reference
log-probs), plus GPT-NeoX's REINFORCE keys. GPT-NeoX files them under ``NeoXArgsTraining`` and, for
``eod_mask_loss``, ``NeoXArgsOther``.

Declared here, beside the objectives that read them; the one argument object (``NeoXArgs``) is
composed of this class and of each objective plug-in's own keys (``DPOKeys``, ``KTOKeys``, here;
``registry.py`` attaches them to their objectives), and the trainer hands
:func:`megatron.objectives.build_objective` its own instance of this group joined with those keys. This module imports no objective implementation (nor torch or DeepSpeed), so the
launcher validates a config without them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.objective_needs import needs_of

ReferenceKind = Literal["none", "frozen_copy", "precomputed", "free"]

NOT_BUILT: tuple[str, ...] = ()
"""GPT-NeoX's ``train_impl`` values Deepy has not built: accepted by the schema, refused as "not
supported yet" before launch (none left: GPT-NeoX's five are built)."""


class ObjectiveArgs(ArgGroup):
    """The objective keys of GPT-NeoX's ``NeoXArgsTraining`` and ``NeoXArgsOther`` groups, with
    Megatron-LM's document-mask keys and Deepy's ``reference_logps``."""

    train_impl: str = "normal"
    """Training objective, a registered objective plug-in (``megatron/objectives/registry.py``):
    language modelling or label-masked SFT (normal), DPO on preference pairs, a pairwise reward model
    with a scalar head (rm), KTO on rewarded completions, GPT-NeoX's online REINFORCE on rollouts from
    rollout servers (reinforce, with dataset_impl: online). Each objective declares its own keys
    (dpo_*, kto_*, reset_*, kl_*)."""

    @field_validator("train_impl")
    @classmethod
    def _registered_objective(cls, value: str) -> str:
        return plugins.validate_name("train_impl", value, not_built=NOT_BUILT)

    z_loss: float = Field(0.0, ge=0)
    """Z-loss weight: language modelling adds z_loss x (log Z)^2 per counted token (the softmax
    normaliser, PaLM); a reward model adds z_loss x (s_chosen^2 + s_rejected^2) per pair (GPT-NeoX)."""

    eod_mask_loss: bool = False
    """Do not train on predicting end-of-document tokens."""

    reset_attention_mask: bool = False
    """Deepy addition (Megatron-LM's key): in a packed sample a token attends only to its own document
    (documents end with the end-of-document token), as if each document were alone."""

    reset_position_ids: bool = False
    """Deepy addition (Megatron-LM's key): positions restart at 0 after each end-of-document token, so
    every document of a packed sample sees the positions it would see alone."""

    reference_logps: str | None = None
    """DPO: the precompute_model_name of reference log-probs written by `generate.py
    text_gen_type=precompute` next to each chosen/rejected dataset (`<prefix>_<name>.bin/.idx`);
    unset uses a frozen copy of the starting weights."""

    fp32_reinforce: bool = True
    """REINFORCE: cast the policy's and the reference's logits to fp32 before the log-softmax (GPT-NeoX's
    get_logp); false takes the log-softmax in the model's precision."""

    kl_impl: Literal["abs", "mse", "kl", "full"] = "mse"
    """REINFORCE's per-token KL penalty against the reference model, from d = log pi(y_t) - log ref(y_t):
    abs |d|, mse d^2/2, kl d, or full: sum over the vocabulary of pi (log pi - log ref) at each position."""

    kl_div_beta: float = 0.1
    """REINFORCE: weight of the KL penalty; a frozen copy of the starting weights is the reference model
    when it is above 0 (GPT-NeoX), none (and no penalty) otherwise."""


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
    if config.train_impl == "reinforce" and not config.kl_div_beta > 0:
        return "none"  # GPT-NeoX builds REINFORCE's reference model only with kl_div_beta > 0
    return "precomputed" if config.reference_logps else "frozen_copy"
