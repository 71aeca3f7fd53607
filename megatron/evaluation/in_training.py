"""lm-evaluation-harness tasks (``eval_tasks``) run inside training at every evaluation.

Before the first step every rank resolves the tasks and reads their documents
(:func:`~megatron.evaluation.harness.load_tasks`), so a task that cannot run stops the run before it trains;
deepy.py refuses the layouts the evaluation cannot run in (``megatron/evaluation/checks.py``).

The model being trained is evaluated where it is: its module on this rank (any tp/pp split) becomes a
:class:`~megatron.generation.replica.ModelReplica`, and the same harness adapter as ``eval.py``
(``megatron/evaluation/``) scores the tasks, so a task's numbers at step N equal ``eval.py``'s on the
step-N checkpoint. Results go to every tracker and ``metrics.jsonl`` as ``lm_eval/<task>/<metric>``.

The training run must not notice: the harness seeds Python's, NumPy's and torch's generators, and
the evaluation forwards run in eval mode, so every random stream (tensor-parallel tracker included)
is captured before and restored after, and the module's train/eval mode is put back. The data stream
is not touched (the tasks bring their own documents).

Under ZeRO-3 every data-parallel rank holds a slice of every weight and each forward gathers them
over the data-parallel group, so all ranks must run the same forwards: each rank then scores every
request instead of its data-parallel share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from megatron.checkpointing.save_load import capture_rng_state, restore_rng_state
from megatron.errors import ConfigError
from megatron.evaluation.config import EvalRun
from megatron.generation.config import SamplingParams
from megatron.generation.modes import TextGenerator
from megatron.generation.replica import ModelReplica


@dataclass(frozen=True)
class TasksInTraining:
    """``config``'s tasks planned for a training run: ``interval`` steps apart (None: at every evaluation), built
    on the engine by calling this (``pretrain``'s ``task_evaluation``; ``train.py`` makes it from ``RunConfig.tasks``)."""

    config: EvalRun

    @property
    def interval(self) -> int | None:
        return self.config.evaluation.eval_tasks_interval

    def __call__(self, eng: Any, tokenizer: Any, zero_stage: int, sequence_parallel: bool) -> TaskEvaluation:
        return TaskEvaluation(eng, tokenizer, self.config, zero_stage, sequence_parallel)


class TaskEvaluation:
    """Runs ``config.evaluation.eval_tasks`` on the training engine's module; ``run()`` returns the metric row."""

    def __init__(self, eng: Any, tokenizer: Any, config: EvalRun, zero_stage: int,
                 sequence_parallel: bool) -> None:
        if sequence_parallel:
            raise ConfigError(
                "eval_tasks with sequence_parallel: true is not supported inside training (the evaluation "
                "forwards use a key/value cache, which cannot split the sequence); remove eval_tasks and run "
                "eval.py on a checkpoint instead (it builds the model without sequence parallelism)")
        # lazy: lm-eval is optional, read only with eval_tasks
        from megatron.evaluation.harness import load_tasks

        self.eng = eng
        self.tokenizer = tokenizer
        self.config = config
        self.every_rank_scores_all = zero_stage == 3
        # an unknown task or one whose documents cannot be read is refused now, before the first step,
        # not at the first evaluation (deepy.py refused what the keys and files could show)
        streams = capture_rng_state()  # building a task must not move the training's random streams
        try:
            load_tasks(config.evaluation.eval_tasks or [])
        finally:
            restore_rng_state(streams)

    def run(self) -> dict[str, float]:
        """``lm_eval/<task>/<metric>`` -> value (the same on every rank) and ``timers/lm_eval_ms``."""
        # lazy: lm-eval is optional, read only with eval_tasks
        from megatron.evaluation.harness import evaluate, metric_rows
        from megatron.evaluation.lm_eval_adapter import DeepyLM

        start = time.perf_counter()
        module = self.eng.engine.module
        was_training = module.training
        streams = capture_rng_state()
        try:
            replica = ModelReplica(module, vocab_size=self.tokenizer.vocab_size, hidden_size=self.eng.config.hidden_size)
            if self.every_rank_scores_all:
                replica.dp_rank, replica.dp_size = 0, 1
            generator = TextGenerator(replica=replica, tokenizer=self.tokenizer,
                                      sampling=SamplingParams.greedy_up_to(self.config.textgen.maximum_tokens),
                                      seq_length=int(self.config.model.seq_length or 0),
                                      batch_size=self.config.batch_size,
                                      seed=self.config.model.seed)
            results = evaluate(DeepyLM(generator), self.config)
        finally:
            module.train(was_training)
            restore_rng_state(streams)
        return {**metric_rows(results), "timers/lm_eval_ms": 1000.0 * (time.perf_counter() - start)}
