"""Checkpoints: save/load through DeepSpeed, commit marker, retention, layout change, preemption.

``CheckpointManager`` owns one run's save directory, retention and preemption flag;
``CheckpointHooks`` adapts it to the training loop (``pretrain`` wires it explicitly).
"""

from megatron.checkpointing.config import CheckpointConfig
from megatron.checkpointing.hooks import CheckpointHooks
from megatron.checkpointing.manager import CheckpointManager

__all__ = ["CheckpointConfig", "CheckpointHooks", "CheckpointManager"]
