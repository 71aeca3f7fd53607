"""What a run hands the engine builder, the memory estimate, the rehearsal and generation: a typed view of
the resolved arguments for each component.

``megatron.neox_arguments.run_config.RunConfig`` provides these views (each is the arguments object
itself, typed as what that component reads, or a frozen object of a group and the shared values it
reads: ``engine``, ``parallel``). The engine, the trainer and generation name them through this protocol,
not through ``RunConfig``, so they do not depend on the argument layer above them
(``tests/unit/test_import_graph.py::test_components_do_not_import_the_argument_layer``); it names the
engine's values (``EngineRun``), not the trainer's, so generation builds a model without the trainer.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRun
from megatron.tokenizer.config import TokenizerArgs
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.engine.config import EngineRun
from megatron.engine.lr_config import LRSchedulerArgs
from megatron.objectives.config import ObjectiveArgs
from megatron.engine.optimizer_config import OptimizerArgs


class RunViews(Protocol):
    """The per-component views of one run's arguments that the engine and the estimate read."""

    @property
    def parallel(self) -> ParallelRun: ...
    @property
    def model(self) -> GPTConfig: ...
    @property
    def tokenizer(self) -> TokenizerArgs: ...
    @property
    def engine(self) -> EngineRun: ...
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
