"""Before-launch checks of ``train_data_weights_schedule``/``mixture_block_size`` and of ``*_data_paths`` entries that
name jsonl shards (``megatron/data/mixture.py``): what Levanter asserts when it builds its mixture (the first stage at
step 0, the others at increasing data offsets that are multiples of the block), said here with the keys and files,
rather than by a rank."""

from __future__ import annotations

from typing import Any

from megatron.config_rules import RuleContext, rule
from megatron.data.batch_schedule import BatchSchedule, schedule_pairs
from megatron.data.mixture_schedule import names_jsonl_shards, stage_problems, stages_at_offsets
from megatron.object_store import is_remote

JSONL_KEYS = ("train_data_paths", "valid_data_paths", "test_data_paths")
"""The path keys whose entries may name jsonl shards (a text dataset each; labels, rewards and pairs are per token or
per sample of a tokenized dataset)."""


def _entries_problems(schedule: Any, paths: list[str] | None) -> list[str]:
    if not isinstance(schedule, list) or not schedule:
        return ["give a list of [step, [one weight per train_data_paths entry]]"]
    problems = []
    count = len(paths or [])
    previous = -1
    for i, entry in enumerate(schedule):
        step, weights = entry
        if len(weights) != count:
            problems.append(f"entry {i} (step {step}) has {len(weights)} weights for {count} train_data_paths")
        elif any(w < 0 for w in weights) or sum(weights) <= 0:
            problems.append(f"entry {i} (step {step}): weights must be non-negative with a positive sum")
        if i == 0 and step != 0:
            problems.append(f"the first entry is at step {step}; the schedule starts at step 0")
        elif step <= previous:
            problems.append(f"entry {i} is at step {step}, not after step {previous}: give the steps in increasing order")
        previous = step
    return problems


@rule
def weights_schedule_is_a_mixture(ctx: RuleContext) -> list[str]:
    """``train_data_weights_schedule``: one weight per path at every entry, steps from 0 increasing, not with the
    other ways to weight the train paths, and each step's data offset a multiple of ``mixture_block_size`` (Levanter
    asserts it, mixture.py:68-80@9263f81e)."""
    schedule = ctx.get("train_data_weights_schedule")
    if schedule is None:
        return []
    shown = ctx.show("train_data_weights_schedule")
    if not ctx.get("train_data_paths"):
        return [f"{shown} weights train_data_paths, which is not set: list the datasets it mixes there"]
    problems = [f"{shown}: {p}" for p in _entries_problems(schedule, ctx.get("train_data_paths"))]
    for key, why in (("train_data_weights", "constant weights"), ("weight_by_num_documents", "weights by size")):
        if ctx.get(key):
            problems.append(f"{shown} and {ctx.show(key)} both weight train_data_paths ({why}): keep one")
    for key in ("train_epochs", "max_train_epochs"):
        if ctx.get(key):
            problems.append(f"{shown} with {ctx.show(key)}: a mixture has no epochs (its sources restart on their own; "
                            "Levanter refuses epochs for mixtures, data/text.py:1228-1229@9263f81e); give train_iters")
    if problems or ctx.get("train_batch_size") is None:
        return problems
    steps = schedule_pairs(ctx.get("train_batch_size_schedule"))
    batches = BatchSchedule.of(steps) if steps else BatchSchedule.fixed(int(ctx.get("train_batch_size")))
    block = int(ctx.get("mixture_block_size"))
    found = stage_problems(stages_at_offsets(schedule, batches), block)
    if found:
        problems.append(
            f"{shown} with {ctx.show('mixture_block_size')}: {'; '.join(found)} (a step's sample is its consumed "
            f"samples, {ctx.show('train_batch_size')} per step); change the steps so each starts a block, or the block")
    return problems


@rule
def jsonl_entries_are_local_text(ctx: RuleContext) -> list[str]:
    """A ``*_data_paths`` entry that names jsonl shards is tokenized into ``cache_dir`` on this file system: it is a
    text dataset of train/valid/test_data_paths, local, with a cache to write to."""
    problems = []
    for key in ("train_label_data_paths", "valid_label_data_paths", "test_label_data_paths",
                "train_reward_data_paths", "valid_reward_data_paths", "test_reward_data_paths",
                "pos_train_data_paths", "neg_train_data_paths", "pos_valid_data_paths", "neg_valid_data_paths"):
        if any(names_jsonl_shards(str(p)) for p in ctx.get(key) or []):
            problems.append(f"{ctx.show(key)} names jsonl shards: only train/valid/test_data_paths entries are "
                            "tokenized from raw text; give a tokenized dataset (.bin/.idx prefix)")
    named = [key for key in JSONL_KEYS if any(names_jsonl_shards(str(p)) for p in ctx.get(key) or [])]
    for key in named:
        remote = [p for p in ctx.get(key) if names_jsonl_shards(str(p)) and is_remote(str(p))]
        if remote:
            problems.append(f"{ctx.show(key)}: {remote[0]} is jsonl in object storage; give raw shards in a bucket "
                            "with train_urls, or a local path here")
    if named and not ctx.get("cache_dir"):
        problems.append(f"{ctx.show(named[0])} names jsonl shards and needs cache_dir: they are tokenized there")
    return problems
