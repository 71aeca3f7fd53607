"""The run ``pretrain`` trains (:class:`TrainConfig`) and the lm-eval runner ``train.py`` hands it
(:class:`TaskEvaluationBuilder`): apart from ``pretrain.py`` so the features' builders (``features/``), which
``pretrain`` calls, read the same types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from megatron.data.config import DataRun
from megatron.checkpointing.config import CheckpointArgs
from megatron.engine.engine_config import EngineConfig
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.config import TrainingRun
from megatron.training.curriculum import CurriculumArgs
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.stragglers import StragglerArgs
from megatron.training.weight_server_config import WeightServerArgs


class TaskRunner(Protocol):
    def run(self) -> dict[str, float]: ...


class TaskEvaluationBuilder(Protocol):
    """Builds what runs the lm-eval tasks (``eval_tasks``) on the engine's module every ``interval`` steps
    (None: at every evaluation): ``megatron.evaluation.in_training.TasksInTraining``, made by ``train.py`` from
    ``RunConfig.tasks`` (evaluation sits above training: it runs the model through generation's replica)."""

    @property
    def interval(self) -> int | None: ...

    def __call__(self, eng: Any, tokenizer: Any, zero_stage: int, sequence_parallel: bool) -> TaskRunner: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig(EngineConfig):
    """The trainer's node of the run's tree of groups: what the engine reads (:class:`EngineConfig`), and the data,
    the loop's keys, the features' groups (each read by its builder in ``features/``), the checkpoint keys and
    the run's name. ``RunConfig`` (the argument layer, above training) is the root and builds every part."""

    data: DataRun
    """What the datasets read: the data keys and the shared ``seq_length``/``seed``/schedule/batch/objective
    values."""
    training: TrainingRun
    """What the loop reads: its own keys and the shared ``seq_length``/``precision``/``seed``/batch sizes."""
    averaging: ModelAveragingArgs
    """The weight average's keys (``ema_beta``)."""
    stragglers: StragglerArgs
    """The straggler watch's keys."""
    weight_server: WeightServerArgs
    """The weight server's keys (``serve_model_weights``, ``weight_server_port``)."""
    bad_steps: BadStepArgs
    """The bad-step rule's keys (``skip_bad_steps_window``, ``_sigma``)."""
    curriculum: CurriculumArgs
    """The sequence curriculum's keys (``curriculum_learning``, ``data_efficiency``), read by the loop."""
    reinit: ReinitTokensArgs
    """The token re-initialisation's keys (``reinit_tokens``)."""
    peft_saves: PeftSaveArgs
    """The PEFT adapter saves' keys (``lora_peft_save_path``, ...)."""
    hf_saves: HFSaveArgs
    """The HF saves' keys (``hf_save_path``, ...)."""
    checkpoint: CheckpointArgs
    """The checkpoint keys."""
    run_name: str | None = None
    """The name deepy.py gave the run (its directory under ``log_dir``); None: the ranks name it."""
