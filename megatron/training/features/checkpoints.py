"""Checkpoints as a feature: the step's checkpoint after every step (by iteration, wall clock or a preemption
signal, ``CheckpointHooks.after_step``) and the last step's when the loop ends (``at_exit``). First in
``FEATURES``: a step's checkpoint is committed before the step's other saves are written, so a run killed inside
one of them resumes from that step and writes it again."""

from __future__ import annotations

from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks
from megatron.training.train_config import TrainConfig


def build_checkpoints(run: TrainConfig, setup: Setup) -> LoopHooks:
    """Always on: without ``save`` the hooks only wait for nothing and save nothing."""
    return LoopHooks(name="checkpoints", after_step=setup.checkpoints.after_step, at_exit=setup.checkpoints.at_exit)
