"""What a training objective (``train_impl``) needs from the rest of the run, read from its plug-in entry.

The data, model, evaluation and checkpoint code read these needs instead of ``train_impl ==`` switches.
Deepy's own objectives are declared here, by name and needs, below every component, because the data config
(``megatron/data/config.py``) and the checkpoints read them while the objectives themselves
(``megatron/objectives/``) sit above the data: ``objectives/registry.py`` attaches their keys, checks and
implementations to these names. A user's objective registers its needs with its class (``plugins.register``).

* ``dataset`` — ``lm`` (token documents, optional label masks), ``pairwise`` (chosen/rejected pairs),
  ``reward`` (documents with a per-document reward) or ``online`` (rollouts fetched from rollout servers,
  ``dataset_impl: online``);
* ``value_head`` — the model ends in a scalar head instead of the LM head;
* ``reference`` — the loss reads a reference model's log-probs;
* ``documents`` — packed samples hold several documents, so the document-mask keys
  (``reset_attention_mask``, ``reset_position_ids``) apply;
* ``min_micro_batch`` — samples one micro-batch must hold, for an objective whose loss compares the
  samples of a micro-batch with each other (refused before launch where the batch is solved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron import plugins

DatasetKind = Literal["lm", "pairwise", "reward", "online"]


@dataclass(frozen=True)
class ObjectiveNeeds:
    dataset: DatasetKind = "lm"
    value_head: bool = False
    reference: bool = False
    documents: bool = False
    min_micro_batch: int = 1


plugins.declare("train_impl", "normal", module=__name__, documents=True)
plugins.declare("train_impl", "dpo", module=__name__, dataset="pairwise", reference=True)
# KTO estimates its KL reference point from mismatched pairs inside a micro-batch: at least 2 samples
plugins.declare("train_impl", "kto", module=__name__, dataset="reward", reference=True, min_micro_batch=2)
plugins.declare("train_impl", "rm", module=__name__, dataset="pairwise", value_head=True)
# GPT-NeoX's online REINFORCE: rewarded rollouts from rollout servers; a reference model when kl_div_beta > 0
plugins.declare("train_impl", "reinforce", module=__name__, dataset="online", reference=True)
plugins.builtins_declared("train_impl")


def needs_of(train_impl: str) -> ObjectiveNeeds:
    """What ``train_impl`` requires from the rest of the run."""
    return ObjectiveNeeds(**plugins.get("train_impl", train_impl).needs)


def known_needs(train_impl: str) -> ObjectiveNeeds | None:
    """What ``train_impl`` requires, or None for a name no plug-in has (a checkpoint's objective whose
    plug-in this run did not load)."""
    entry = plugins.find("train_impl", train_impl)
    return None if entry is None else ObjectiveNeeds(**entry.needs)


def reads_reference_files(train_impl: str) -> bool:
    """Whether the objective's reference log-probs may come from files written next to its pairs
    (``reference_logps``, by ``generate.py`` precompute): a pairwise objective with a reference (DPO)."""
    needs = needs_of(train_impl)
    return needs.reference and needs.dataset == "pairwise"
