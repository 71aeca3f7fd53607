"""Before-launch checks of the objectives: the keys some objectives share, and the data each
objective reads (registered with the other config checks,
``megatron/config_rules.py``; one objective's own checks are declared with it in ``registry.py``).
"""

from __future__ import annotations

from pathlib import Path

from megatron import plugins
from megatron.checkpointing.discovery import resume_point
from megatron.config_rules import RuleContext, rule
from megatron.data.config import SPLITS
from megatron.objective_needs import needs_of, reads_reference_files
from megatron.objectives.config import ObjectiveArgs, reference_kind
from megatron.objectives.starting_point import other_objective_problem

_PAIRWISE_DATA_KEYS = tuple(f"{side}_{split}_data_paths" for side in ("pos", "neg") for split in SPLITS)
_REWARD_DATA_KEYS = tuple(f"{split}_reward_data_paths" for split in SPLITS)


def _train_impl(ctx: RuleContext) -> str:
    return str(ctx.get("train_impl") or "normal")


@rule
def objective_keys_match_train_impl(ctx: RuleContext) -> list[str]:
    """Keys shared by some objectives but not all, read only by those."""
    impl, problems = _train_impl(ctx), []
    needs = plugins.find("train_impl", impl)
    documents = [key for key in ("reset_attention_mask", "reset_position_ids") if ctx.given(key)]
    if documents and needs is not None and not needs.needs.get("documents"):
        # the other objectives read whole, unpacked documents: nothing to keep apart
        problems.append(f"{', '.join(ctx.show(k) for k in documents)} only apply to objectives reading packed "
                        f"documents ({', '.join(p.name for p in plugins.of_family('train_impl') if p.needs.get('documents'))}; "
                        f"{ctx.show('train_impl')}): remove them")
    if ctx.get("z_loss") and impl not in ("normal", "rm"):
        problems.append(f"{ctx.show('z_loss')} applies to language modelling and reward models, not to "
                        f"{ctx.show('train_impl')}: remove z_loss")
    if ctx.get("reference_logps") and not reads_reference_files(impl):
        why = ("KTO's reference point comes from mismatched prompt/completion pairs built inside each micro-batch, "
               "which no per-dataset file holds; KTO takes its reference from a frozen copy of the starting "
               "weights") if impl == "kto" else f"{ctx.show('train_impl')} has no reference model"
        problems.append(f"{ctx.show('reference_logps')} is read by train_impl dpo only ({why}): remove it")
    return problems


@rule
def objective_data_matches_train_impl(ctx: RuleContext) -> list[str]:
    """Each objective reads its own kind of data; say which keys to set when the config gives another."""
    impl, problems = _train_impl(ctx), []
    dummy = bool(ctx.get("use_dummy_dataset"))
    pairs = [key for key in _PAIRWISE_DATA_KEYS if ctx.get(key)]
    rewards = [key for key in _REWARD_DATA_KEYS if ctx.get(key)]
    packed = ctx.given("pack_impl") and ctx.get("pack_impl") != "unpacked"
    reads = needs_of(impl).dataset
    pairwise = " or ".join(p.name for p in plugins.of_family("train_impl") if p.needs.get("dataset") == "pairwise")
    if reads == "pairwise":
        if not dummy and not ctx.get("pos_train_data_paths"):
            problems.append(f"{ctx.show('train_impl')} trains on preference pairs: set pos_train_data_paths and "
                            "neg_train_data_paths (written by tools/datasets/preprocess_data_with_mask.py "
                            "--mode pairwise), or use_dummy_dataset: true")
        for key in ("data_path", "train_data_paths", "train_urls"):
            if ctx.get(key):
                problems.append(f"{ctx.show(key)} is not read by {ctx.show('train_impl')}, which trains on "
                                "pos_/neg_train_data_paths: remove it")
        if ctx.given("dataset_impl") and ctx.get("dataset_impl") != "pairwise":
            problems.append(f"{ctx.show('dataset_impl')} with {ctx.show('train_impl')}: the data are pairs; "
                            "set dataset_impl: pairwise or remove it")
    else:
        if pairs:
            problems.append(f"{', '.join(ctx.show(k) for k in pairs)} hold preference pairs, read by train_impl "
                            f"{pairwise} only ({ctx.show('train_impl')})")
        if ctx.get("dataset_impl") == "pairwise":
            problems.append(f"{ctx.show('dataset_impl')} needs train_impl: {pairwise} ({ctx.show('train_impl')})")
    if reads == "reward":
        if not dummy and not ctx.get("train_reward_data_paths"):
            problems.append(f"{ctx.show('train_impl')} needs per-document rewards: set train_data_paths, "
                            "train_label_data_paths and train_reward_data_paths (written by "
                            "tools/datasets/preprocess_data_with_mask.py --mode reward), or use_dummy_dataset: true")
    elif rewards:
        readers = " or ".join(p.name for p in plugins.of_family("train_impl") if p.needs.get("dataset") == "reward")
        problems.append(f"{', '.join(ctx.show(k) for k in rewards)} are per-document rewards for train_impl: "
                        f"{readers} ({ctx.show('train_impl')}): remove them or set train_impl: {readers}")
    if reads != "lm" and packed:
        problems.append(f"{ctx.show('pack_impl')} with {ctx.show('train_impl')}: its samples are whole documents "
                        "(a reward or preference belongs to one response), never packed; set pack_impl: unpacked "
                        "or remove it")
    return problems


@rule
def resumed_reference_keeps_its_objective(ctx: RuleContext) -> list[str]:
    """A frozen reference copy of the starting weights is found from the checkpoints on disk when the run starts
    (``starting_point.starting_point``): resuming, with ``load``, a checkpoint another objective wrote would lose
    it at the next resume, and the ranks refuse it before their first step; the same check, here."""
    load = ctx.get("load")
    if not ctx.trains or not load or ctx.get("initialize_from") or ctx.get("finetune"):
        return []

    if reference_kind(ctx.group(ObjectiveArgs)) != "frozen_copy":
        return []

    found = resume_point(Path(str(load)), None)  # the newest committed checkpoint, as starting_point reads it
    if found is None:
        return []
    problem = other_objective_problem(str(load), found[1].get("args") or {}, _train_impl(ctx))
    return [] if problem is None else [f"{ctx.show('train_impl')} with {ctx.show('load')}: {problem}"]
