"""What a feature's builder reads besides the run's keys (:class:`Setup`), and the pieces two builders share.

A builder is ``build(run, setup) -> LoopHooks | None``: None when the run's keys leave the feature off, else the
feature's events in the loop (``megatron.training.loop.LoopHooks``). It runs once, after the checkpoint load and
the run's header, before the first step; what must wait for the loaded state (an EMA read back from the checkpoint,
a save a killed run left missing) is the hooks' ``resume``, which the loop calls before its first step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.manager import CheckpointHooks
from megatron.engine.build import Engine
from megatron.model.pipeline import model_parameter_name
from megatron.tokenizer.base import Tokenizer
from megatron.training.hf_saves import HFWriterFactory, Weights, gathered_parameters, live_weights
from megatron.training.loop import EvalWeights, LoopHooks
from megatron.training.train_config import TaskEvaluationBuilder
from megatron.training.step_saves import StepSaves


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The run's parts once its checkpoint is loaded, as the features' builders read them."""

    eng: Engine
    """The engine the loop trains (``eng.config``: the model, a reward model's scalar head included)."""
    tokenizer: Tokenizer
    checkpoint_keys: CheckpointArgs
    """``RunConfig.checkpoint`` (the PEFT saves name ``initialize_from_hf`` as their base model)."""
    checkpoints: CheckpointHooks
    """The run's checkpoints: the loaded one (``manager.resumed_from``) and the files each save writes
    (``manager.rank_files``)."""
    zero_stage: int
    """The engine's ZeRO stage, read once (3: the parameters are partitioned, gathered to be read whole)."""
    train_iters: int
    """The run's last step (``train_iters``, or where ``max_train_epochs`` end)."""
    say: Callable[[str], None]
    """A console line from the speaking rank (``Monitor.message``)."""
    metrics_dir: str | None = None
    """``<log_dir>/<run_name>``, where metrics.jsonl and its event rows go (None: no ``log_dir``)."""
    task_evaluation: TaskEvaluationBuilder | None = None
    """What runs the lm-eval tasks (``eval_tasks``), handed to ``pretrain`` by ``train.py``."""
    hf_writer: HFWriterFactory | None = None
    """The HF saves' writer (``hf_save_path``), handed to ``pretrain`` by ``train.py``."""
    train_data: Any = None
    """The train split the loop reads (a ``StreamingDataset`` keeps its position in the checkpoint)."""
    eval_weights: EvalWeights | None = None
    """The weights an earlier feature keeps beside the trained ones (the EMA), which later features' saves write
    in their place (Levanter's ``eval_model``); set by ``build_hooks``."""

    @property
    def rank(self) -> int:
        """This process's global rank (0 without ``torch.distributed``)."""
        return dist.get_rank() if dist.is_initialized() else 0

    def saved_weights(self, gathered: list[torch.nn.Parameter]) -> Callable[[], Weights]:
        """What a save writes: the module's weights under ``GPTModel``'s names, the EMA's in place of the trained
        ones when there is one; under ZeRO-3 ``gathered`` (the parameters the save reads) are gathered first. Every
        rank calls it, rank 0 keeps the tensors."""
        keep = self.rank == 0
        weights = self.eval_weights
        return live_weights(self.eng.engine.module, None if weights is None else lambda: weights.whole(keep),
                            gathered_parameters(gathered) if self.zero_stage == 3 else None, keep=keep,
                            rename=model_parameter_name if self.eng.is_pipe else None)  # a one-stage pipeline


def step_saves_hooks(name: str, saves: StepSaves, last: int) -> LoopHooks:
    """The hooks of directories written at Levanter's hook steps (``step_saves.StepSaves``), after the step's
    checkpoint; ``resume`` writes the save a run killed while writing it left missing (``last``: the run's last
    step)."""
    return LoopHooks(name=name, resume=lambda _eng, state: saves.resume(state.iteration, last),
                     after_step=saves.after_step, at_exit=saves.at_exit)
