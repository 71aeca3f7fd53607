"""The run ``pretrain`` trains (:class:`PretrainRun`) and the lm-eval runner ``train.py`` hands it
(:class:`TaskEvaluationBuilder`): apart from ``pretrain.py`` so the features' builders (``features/``), which
``pretrain`` calls, read the same types."""

from __future__ import annotations

from typing import Any, Protocol

from megatron.data.config import DataRun
from megatron.engine.run_views import RunViews
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.config import TrainingRun
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.stragglers import StragglerArgs


class TaskRunner(Protocol):
    def run(self) -> dict[str, float]: ...


class TaskEvaluationBuilder(Protocol):
    """Builds what runs the lm-eval tasks (``eval_tasks``) on the engine's module every ``interval`` steps
    (None: at every evaluation): ``megatron.evaluation.in_training.TasksInTraining``, made by ``train.py`` from
    ``RunConfig.tasks`` (evaluation sits above training: it runs the model through generation's replica)."""

    @property
    def interval(self) -> int | None: ...

    def __call__(self, eng: Any, tokenizer: Any, zero_stage: int, sequence_parallel: bool) -> TaskRunner: ...


class PretrainRun(RunViews, Protocol):
    """The run ``pretrain`` trains: the views the engine reads (:class:`RunViews`), the data keys, and the
    run's record and name. ``RunConfig`` provides them (the argument layer, above training)."""

    @property
    def data(self) -> DataRun: ...
    @property
    def training(self) -> TrainingRun: ...
    @property
    def averaging(self) -> ModelAveragingArgs: ...

    @property
    def stragglers(self) -> StragglerArgs: ...
    @property
    def bad_steps(self) -> BadStepArgs: ...
    @property
    def reinit(self) -> ReinitTokensArgs: ...
    @property
    def peft_saves(self) -> PeftSaveArgs: ...
    @property
    def hf_saves(self) -> HFSaveArgs: ...
    @property
    def args_record(self) -> dict[str, Any]:
        """Every resolved key as JSON (stored in checkpoints to describe the run)."""
        ...
    @property
    def run_name(self) -> str | None:
        """The name deepy.py gave the run; None: the ranks name it."""
        ...
