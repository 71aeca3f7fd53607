"""What a run hands the engine builder, the memory estimate, the rehearsal and generation: :class:`EngineConfig`,
the engine's node of the run's tree of groups.

Each field is the instance of a group declared beside the component that reads it (``GPTConfig`` with the model,
``LoRAArgs`` with the adapters, ...), or a frozen object of a group and the shared values it reads (``engine``,
``parallel``). The trainer's node (``megatron/training/train_config.py``'s ``TrainConfig``) adds what the loop
reads; the argument layer's ``RunConfig`` is the root and builds every part from the resolved arguments. The
engine and generation take this node, not ``RunConfig``, so they do not depend on the argument layer above
them (``tests/unit/test_import_graph.py``), nor on the trainer's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.engine.config import EngineRun
from megatron.engine.lr_config import LRSchedulerArgs
from megatron.engine.optimizer_config import OptimizerArgs
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRun
from megatron.objectives.config import ObjectiveArgs
from megatron.tokenizer.config import TokenizerArgs


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The groups building a model and its DeepSpeed engine read."""

    parallel: ParallelRun
    """What splits the run over ranks: the parallel sizes and the rendezvous."""
    model: GPTConfig
    """The architecture's keys; sized for the tokenizer with ``for_tokenizer`` (a new object)."""
    tokenizer: TokenizerArgs
    """The tokenizer's keys."""
    engine: EngineRun
    """The engine's keys and the shared ``seq_length``/``precision``/``seed``/batch sizes/``train_iters``."""
    optimizer_config: OptimizerArgs
    """The optimizer's keys."""
    lr_config: LRSchedulerArgs
    """The LR schedule's keys (with the keys of the schedules that declare their own)."""
    activation_config: ActivationCheckpointArgs
    """Activation checkpointing's keys."""
    logging: LoggingArgs
    """The logging keys (the memory estimate's device memory, DeepSpeed's log level)."""
    lora: LoRAArgs
    """The adapter keys (``lora_r == 0``: none, every parameter trains)."""
    objective: ObjectiveArgs
    """The objective's keys: ``train_impl``, the shared keys and the plug-ins' own (DPO/KTO settings)."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config dict deepy.py split off (batch sizes, precision, ZeRO, ...)."""
    args_record: dict[str, Any] = field(default_factory=dict)
    """Every resolved key as JSON (stored in checkpoints to describe the run; never read for settings)."""
