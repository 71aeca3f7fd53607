"""What a training run hands the engine builder and the memory estimate: a typed view of the resolved
arguments for each component.

``megatron.neox_arguments.run_config.RunConfig`` provides these views (each is the arguments object
itself, typed as what that component reads). The training code names them through this protocol, not
through ``RunConfig``, so it does not depend on the argument layer above it
(``tests/unit/test_import_graph.py::test_components_do_not_import_the_argument_layer``).
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRun
from megatron.tokenizer.config import TokenizerArgs
from megatron.training.activation_config import ActivationCheckpointArgs
from megatron.training.config import TrainingRun
from megatron.training.lr_config import LRSchedulerArgs
from megatron.training.objectives.config import ObjectiveArgs
from megatron.training.optimizer_config import OptimizerArgs


class RunViews(Protocol):
    """The per-component views of one run's arguments that the engine and the estimate read."""

    @property
    def parallel(self) -> ParallelRun: ...
    @property
    def model(self) -> GPTConfig: ...
    @property
    def tokenizer(self) -> TokenizerArgs: ...
    @property
    def training(self) -> TrainingRun: ...
    @property
    def optimizer_config(self) -> OptimizerArgs: ...
    @property
    def lr_config(self) -> LRSchedulerArgs: ...
    @property
    def activation_config(self) -> ActivationCheckpointArgs: ...
    @property
    def logging(self) -> LoggingArgs: ...
    @property
    def lora(self) -> LoRAArgs: ...
    @property
    def objective(self) -> ObjectiveArgs: ...
    @property
    def deepspeed_config(self) -> dict[str, Any]: ...
