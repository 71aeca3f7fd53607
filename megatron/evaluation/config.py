"""The lm-evaluation-harness keys: the tasks eval.py runs, and that training runs at every evaluation
(GPT-NeoX files ``eval_tasks`` and ``eval_results_prefix`` under ``NeoXArgsTextgen``).

Declared here, beside the evaluation that reads them. Evaluation also reads keys other components own (the
context, the batch, the sampling length, the seed, the log directory): :class:`EvalRun` holds the groups
that declare them (the arguments object, typed as each), so nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError
from megatron.generation.config import TextgenArgs
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig


class EvalArgs(ArgGroup):
    """Deepy's evaluation group (``NeoXArgsTextgen`` in GPT-NeoX)."""

    eval_results_prefix: str = ""
    """eval.py writes `<prefix>_eval_results.json` (and per-task samples); empty: into log_dir."""

    eval_tasks: list[str] | None = None
    """lm-evaluation-harness tasks (names or paths of task YAML files) that eval.py runs, and that train.py runs
    at every eval_interval and after the last step, logging lm_eval/<task>/<metric>."""

    eval_tasks_interval: int | None = Field(None, ge=1)
    """train.py runs eval_tasks every this many steps (and after the last step); None: every eval_interval.
    Deepy extra (Levanter's eval_harness_steps)."""

    eval_tasks_limit: int | None = Field(None, ge=1)
    """Evaluate at most this many documents of each task (lm-evaluation-harness' `limit`: the first ones);
    None: every document. Deepy extra (Levanter's eval_harness.max_examples)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalRun:
    """What evaluation reads, from the groups that declare it: every field but ``batch_size`` is that group's own
    instance (its keys only). ``batch_size``, the requests run together, is derived
    once from ``train_micro_batch_size_per_gpu``, a key of ``neox_arguments``' DeepSpeed group (above this
    package): ``megatron.neox_arguments.component_groups.evaluation_run`` builds this from the arguments."""

    evaluation: EvalArgs
    """The tasks, their limit and interval, the results prefix."""
    model: GPTConfig
    """The context the evaluated model reads (``seq_length``) and the seed of lm-eval's sampling."""
    textgen: TextgenArgs
    """``maximum_tokens`` of generate_until requests without ``max_gen_toks``."""
    logging: LoggingArgs
    """``log_dir``: where results go without a prefix, and the metrics row."""
    batch_size: int


def checked(run: EvalRun) -> EvalRun:
    """``run`` when evaluation can run from it; a clear error before the model is built otherwise."""
    if not run.evaluation.eval_tasks:
        raise ConfigError(
            "eval.py needs eval_tasks: lm-evaluation-harness task names or task YAML paths, "
            "e.g. eval_tasks=[lambada_openai] or eval_tasks=[my_tasks/task.yaml]"
        )
    if run.model.seq_length is None:
        raise ConfigError("seq_length must be set: it is the context the evaluated model reads")
    return run

