"""``eval_tasks`` as a feature: the lm-eval tasks every ``eval_tasks_interval`` steps (else every ``eval_interval``)
and after the last step, after the step's validation and before its test evaluation, on the evaluated weights (the
EMA's when there is one: Levanter runs lm-eval on ``eval_model``), logged as their own row (``lm_eval/...``)."""

from __future__ import annotations

from megatron.training.features.base import Setup
from megatron.training.loop import Evaluation, LoopHooks
from megatron.training.train_config import TrainConfig


def build_tasks(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None when ``pretrain`` was given no task evaluation (the config names no ``eval_tasks``)."""
    tasks = setup.task_evaluation
    if tasks is None:
        return None
    every = tasks.interval or run.training.loop.eval_interval
    runner = tasks(setup.eng, setup.tokenizer, zero_stage=setup.zero_stage,
                   sequence_parallel=run.model.sequence_parallel and run.parallel.model_parallel_size > 1)

    def due(iteration: int, last: bool) -> bool:
        return last or (bool(every) and iteration % int(every or 1) == 0)

    return LoopHooks(name="eval_tasks", evaluation=Evaluation(due=due, run=runner.run))
