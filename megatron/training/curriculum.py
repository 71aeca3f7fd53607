"""Sequence-length curriculum: the early steps train on the first ``L`` tokens of every sample, ``L`` growing
with the step to ``seq_length``, as GPT-NeoX's ``curriculum_learning`` block asks. GPT-NeoX files these keys
(``curriculum_learning``, ``curriculum_seqlen``, ``data_efficiency``) under ``NeoXArgsDeepspeedConfig``; they are
declared here, beside the loop that reads them.

GPT-NeoX (EleutherAI/gpt-neox ea7aefd8, megatron/training.py) builds DeepSpeed's ``CurriculumScheduler`` from the
block (``setup_model_and_optimizer``: ``CurriculumScheduler(neox_args.curriculum_learning)``, brought forward with
``update_difficulty(iteration)`` on a resumed run) and, for every micro-batch of a step, asks it
``update_difficulty(neox_args.iteration + 1)`` (the step about to run, 1-based) and cuts tokens, positions, labels
and the loss mask to that many columns when it is below the sample's length (``get_batch_pipe``). Deepy does the
same with the same scheduler (DeepSpeed 0.19.8, deepspeed/runtime/data_pipeline/curriculum_scheduler.py), built
here: DeepSpeed 0.19.8 refuses the legacy top-level block in its own config (runtime/config.py
``_REMOVED_TOP_LEVEL_CONFIG_KEYS``), so it never goes there. The cut is made on the prepared micro-batch
(``MicroBatch.truncated``), before its loss units are counted, so the loss is the mean over the kept tokens.

DeepSpeed's new spelling, ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen_truncate``
(Megatron-DeepSpeed's name for the same cut), drives the same schedule. DeepSpeed 0.19.8 itself acts on
``data_efficiency`` only through its own data loader (``deepspeed.initialize(training_data=...)``: the
``DataSampler`` reads the data analyzer's index files) and through Random-LTD layers in the model; Deepy's
loader and model are its own, so the block stays out of DeepSpeed's config and every other part of it is
refused by name before launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from megatron.config_rules import RuleContext, describe, rule
from megatron.config_schema import ArgGroup, obsolete

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")
"""DeepSpeed's schedules that need no Python function (``custom`` does: set through the engine's API)."""
SEQLEN_METRIC = "seqlen_truncate"
"""The ``data_efficiency`` metric that cuts sequences (Megatron-DeepSpeed's name)."""


class CurriculumArgs(ArgGroup):
    """GPT-NeoX files these under ``NeoXArgsDeepspeedConfig``; declared here, beside the loop that reads them."""

    curriculum_learning: dict[str, Any] | None = None
    """Sequence-length curriculum (DeepSpeed's legacy block): {enabled, curriculum_type: seqlen, min_difficulty,
    max_difficulty, schedule_type: fixed_linear|fixed_root|fixed_discrete, schedule_config: {total_curriculum_step,
    difficulty_step, root_degree} or {difficulty: [...], max_step: [...]}}. Step n (1-based) trains on the first
    CurriculumScheduler.update_difficulty(n) tokens of every sample (all of them once that reaches seq_length),
    logged as train/curriculum_seqlen. Built by Deepy, not handed to DeepSpeed 0.19.8, which removed the block."""

    curriculum_seqlen: int = obsolete(0, (
        "the current length of GPT-NeoX's sequence curriculum, state its code writes at run time "
        "(megatron/model/utils.py update_value), not a setting: remove it; set curriculum_learning, and read "
        "the length as train/curriculum_seqlen"))
    """GPT-NeoX's run-time state of the curriculum (its current sequence length), not a setting; logged as
    train/curriculum_seqlen."""

    data_efficiency: dict[str, Any] | None = None
    """DeepSpeed's data-efficiency block. Its sequence-length curriculum (data_sampling.curriculum_learning with the
    one metric seqlen_truncate: min_difficulty, max_difficulty, schedule_type, schedule_config) runs as
    curriculum_learning does; the parts that need DeepSpeed's data loader or data analyzer (other metrics,
    dynamic_batching) and Random-LTD (data_routing) are refused."""

    def seqlen_schedule(self) -> dict[str, Any] | None:
        """The ``CurriculumScheduler`` config of the sequence curriculum these keys turn on; None when off."""
        legacy = self.curriculum_learning
        if legacy is not None and legacy.get("enabled", False):
            return dict(legacy)
        metric = _seqlen_metric(self.data_efficiency)
        return None if metric is None else dict(metric)


def _enabled(block: Any) -> TypeGuard[Mapping[str, Any]]:
    """A DeepSpeed block that is on (``{enabled: true, ...}``)."""
    return isinstance(block, Mapping) and bool(block.get("enabled", False))


def _curriculum_block(data_efficiency: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``data_sampling.curriculum_learning`` when data efficiency, sampling and the curriculum are all on."""
    if not _enabled(data_efficiency):
        return None
    sampling = data_efficiency.get("data_sampling")
    if not _enabled(sampling):
        return None
    block = sampling.get("curriculum_learning")
    return block if _enabled(block) else None


def _seqlen_metric(data_efficiency: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    block = _curriculum_block(data_efficiency)
    metrics = block.get("curriculum_metrics") if block is not None else None
    metric = metrics.get(SEQLEN_METRIC) if isinstance(metrics, Mapping) else None
    return metric if isinstance(metric, Mapping) else None


class SeqlenCurriculum:
    """The length each step trains on, from DeepSpeed's own scheduler (its state: the current difficulty, which
    stops moving once it reaches ``max_difficulty``)."""

    def __init__(self, schedule: Mapping[str, Any], seq_length: int, completed_steps: int) -> None:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler  # lazy: training only

        self.seq_length = seq_length
        self.scheduler = CurriculumScheduler(dict(schedule))
        if completed_steps > 0:  # a resumed run: GPT-NeoX brings the scheduler to the loaded iteration
            self.scheduler.update_difficulty(completed_steps)
        self.current = seq_length

    def length_at(self, step: int) -> int:
        """The tokens per sample of 1-based step ``step`` (the run's next step: called once per step, in order)."""
        self.current = min(int(self.scheduler.update_difficulty(step)), self.seq_length)
        return self.current


def build_curriculum(keys: CurriculumArgs, seq_length: int, completed_steps: int) -> SeqlenCurriculum | None:
    """The run's curriculum, or None when its keys leave it off."""
    schedule = keys.seqlen_schedule()
    return None if schedule is None else SeqlenCurriculum(schedule, seq_length, completed_steps)


# --- checks before launch --------------------------------------------------------------------------
def _schedule_problems(where: str, block: Mapping[str, Any], seq_length: int | None) -> list[str]:
    """What DeepSpeed's ``CurriculumScheduler`` would assert on, said before launch."""
    problems = []
    missing = [k for k in ("min_difficulty", "max_difficulty", "schedule_type") if k not in block]
    if missing:
        return [f"{where}: needs {', '.join(missing)} (DeepSpeed's CurriculumScheduler)"]
    low, high, kind = block["min_difficulty"], block["max_difficulty"], block["schedule_type"]
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        problems.append(f"{where}: min_difficulty={low!r} and max_difficulty={high!r} must be token counts with "
                        f"1 <= min_difficulty <= max_difficulty")
    elif seq_length is not None and high > seq_length:
        problems.append(f"{where}: max_difficulty={high} is longer than seq_length={seq_length}: a sample has no more "
                        f"tokens to give; set max_difficulty to seq_length")
    if kind not in SCHEDULE_TYPES:
        why = (" (custom needs a Python schedule function handed to DeepSpeed's engine, which a config cannot carry)"
               if kind == "custom" else "")
        problems.append(f"{where}: schedule_type={kind!r} is not one of {', '.join(SCHEDULE_TYPES)}{why}")
        return problems
    config = block.get("schedule_config")
    if not isinstance(config, Mapping):
        return problems + [f"{where}: schedule_type {kind} needs a schedule_config mapping"]
    needs = {"fixed_discrete": ("difficulty", "max_step"),
             "fixed_linear": ("total_curriculum_step", "difficulty_step"),
             "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree")}[kind]
    absent = [k for k in needs if k not in config]
    if absent:
        problems.append(f"{where}: schedule_type {kind} needs schedule_config.{', schedule_config.'.join(absent)}")
    elif kind == "fixed_discrete":
        levels, steps = config["difficulty"], config["max_step"]
        if not (isinstance(levels, list) and isinstance(steps, list) and steps and len(levels) == len(steps) + 1):
            problems.append(f"{where}: schedule_config.difficulty needs one more entry than schedule_config.max_step "
                            f"(the last length holds after the last max_step), got {levels!r} and {steps!r}")
        elif seq_length is not None and any(not isinstance(v, int) or v < 1 or v > seq_length for v in levels):
            problems.append(f"{where}: schedule_config.difficulty={levels!r} must be lengths from 1 to "
                            f"seq_length={seq_length}")
    elif not (isinstance(config["total_curriculum_step"], int) and config["total_curriculum_step"] >= 1
              and isinstance(config["difficulty_step"], int) and config["difficulty_step"] >= 1):
        problems.append(f"{where}: schedule_config.total_curriculum_step and difficulty_step must be integers >= 1")
    return problems


def _data_efficiency_problems(ctx: RuleContext) -> list[str]:
    block = ctx.get("data_efficiency")
    if not _enabled(block):
        return []
    where = describe(ctx.source("data_efficiency"))
    problems = []
    routing = block.get("data_routing")
    if _enabled(routing):
        problems.append(f"data_efficiency.data_routing ({where}): Random-LTD drops tokens inside DeepSpeed's "
                        f"RandomLayerTokenDrop layers, which Deepy's model does not have: turn data_routing off")
    sampling = block.get("data_sampling")
    if _enabled(sampling) and isinstance(sampling.get("dynamic_batching"), Mapping) \
            and sampling["dynamic_batching"].get("enabled", False):
        problems.append(f"data_efficiency.data_sampling.dynamic_batching ({where}): DeepSpeed batches by token count "
                        f"only in its own data loader, from the data analyzer's metric files; Deepy's batches are "
                        f"train_micro_batch_size_per_gpu samples: turn it off")
    curriculum = _curriculum_block(block)
    if curriculum is None:
        return problems
    metrics = curriculum.get("curriculum_metrics")
    if not isinstance(metrics, Mapping) or not metrics:
        return problems + [f"data_efficiency.data_sampling.curriculum_learning ({where}): needs curriculum_metrics"]
    others = sorted(name for name in metrics if name != SEQLEN_METRIC)
    if others:
        problems.append(f"data_efficiency curriculum_metrics {others} ({where}): DeepSpeed orders samples by these "
                        f"only in its own data loader, from index files its data analyzer writes "
                        f"(index_to_sample_path, index_to_metric_path); Deepy's loader has neither. Only "
                        f"{SEQLEN_METRIC} (cut every sample to the scheduled length) runs")
    metric = metrics.get(SEQLEN_METRIC)
    if isinstance(metric, Mapping):
        problems += _schedule_problems(f"data_efficiency...curriculum_metrics.{SEQLEN_METRIC} ({where})", metric,
                                       ctx.get("seq_length"))
    return problems


@rule
def curriculum_is_runnable(ctx: RuleContext) -> list[str]:
    """The sequence curriculum's blocks say what DeepSpeed's scheduler needs, and the run can cut its samples."""
    keys = ctx.group(CurriculumArgs)
    legacy = keys.curriculum_learning
    problems = []
    if _enabled(legacy):
        where = f"curriculum_learning ({describe(ctx.source('curriculum_learning'))})"
        kind = legacy.get("curriculum_type", "seqlen")
        if kind != "seqlen":
            problems.append(f"{where}: curriculum_type={kind!r}: GPT-NeoX's curriculum cuts sequences only "
                            f"(curriculum_type: seqlen)")
        problems += _schedule_problems(where, legacy, ctx.get("seq_length"))
        if _curriculum_block(keys.data_efficiency) is not None:
            problems.append(f"{where}: data_efficiency.data_sampling.curriculum_learning "
                            f"({describe(ctx.source('data_efficiency'))}) is a second curriculum: keep one")
    problems += _data_efficiency_problems(ctx)
    if keys.seqlen_schedule() is None or problems:
        return problems
    key = "curriculum_learning" if _enabled(legacy) else "data_efficiency"
    chosen = f"{key} ({describe(ctx.source(key))})"
    if ctx.get("train_impl") != "normal":
        problems.append(f"{chosen}: the sequence curriculum cuts language-modelling samples; "
                        f"{ctx.show('train_impl')} pairs or scores whole sequences (GPT-NeoX asserts the same): "
                        f"use train_impl: normal")
    if ctx.cp > 1:
        problems.append(f"{chosen}: with {ctx.show('context_parallel_size')} every length would have to "
                        f"split into equal pieces: use context_parallel_size: 1")
    if ctx.get("sequence_parallel") and ctx.tp > 1:
        problems.append(f"{chosen}: with {ctx.show('sequence_parallel')} every length would have to split "
                        f"over model_parallel_size={ctx.tp}: turn sequence_parallel off")
    return problems
