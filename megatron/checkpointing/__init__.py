"""Checkpoints: save/load through DeepSpeed, commit marker, retention, layout change, preemption.

``load``, ``maybe_save`` and ``save_at_exit`` are the hooks the training loop calls (see
``hooks.py``); ``CheckpointManager`` is the same machinery for callers that hold their own engine.
"""

from megatron.checkpointing.hooks import load, maybe_save, save_at_exit
from megatron.checkpointing.manager import CheckpointManager

__all__ = ["CheckpointManager", "load", "maybe_save", "save_at_exit"]
