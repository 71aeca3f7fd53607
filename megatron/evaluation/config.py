"""The lm-evaluation-harness keys: the tasks eval.py runs, and that training runs at every evaluation
(GPT-NeoX files ``eval_tasks`` and ``eval_results_prefix`` under ``NeoXArgsTextgen``).

Declared here, beside the evaluation that reads them. Evaluation also reads keys other components own (the
context, the batch, the sampling length, the seed, the log directory): :class:`EvalRunArgs` names them
all, and the arguments object itself satisfies it, so nothing is copied.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError


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


class EvalRunArgs(Protocol):
    """Every key evaluation reads, its own (:class:`EvalArgs`) and the shared ones; read-only, so any
    object holding them (``NeoXArgs``) satisfies it."""

    @property
    def eval_tasks(self) -> list[str] | None: ...
    @property
    def eval_tasks_limit(self) -> int | None: ...
    @property
    def eval_tasks_interval(self) -> int | None: ...
    @property
    def eval_results_prefix(self) -> str: ...
    @property
    def log_dir(self) -> str | None: ...
    @property
    def seq_length(self) -> int | None: ...
    @property
    def train_micro_batch_size_per_gpu(self) -> int | None: ...
    @property
    def maximum_tokens(self) -> int: ...
    @property
    def seed(self) -> int: ...


def checked(args: EvalRunArgs) -> EvalRunArgs:
    """``args`` when evaluation can run from it; a clear error before the model is built otherwise."""
    if not args.eval_tasks:
        raise ConfigError(
            "eval.py needs eval_tasks: lm-evaluation-harness task names or task YAML paths, "
            "e.g. eval_tasks=[lambada_openai] or eval_tasks=[my_tasks/task.yaml]"
        )
    if args.seq_length is None:
        raise ConfigError("seq_length must be set: it is the context the evaluated model reads")
    return args

