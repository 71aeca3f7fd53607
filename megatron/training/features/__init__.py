"""The features that plug into the training loop, each through its hooks (``megatron.training.loop.LoopHooks``).

A feature is one builder ``build(run, setup) -> LoopHooks | None`` in its own module here: it reads its keys from the
run and what else it needs from :class:`~megatron.training.features.base.Setup`, and returns None when its keys leave
it off. :data:`FEATURES` lists them in the order the loop calls their events (Levanter's ``Trainer.add_hook``, made
once, in one place): the loop itself names none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from megatron.training.features.averaging import build_averaging
from megatron.training.features.bad_steps import build_bad_steps
from megatron.training.features.base import Setup
from megatron.training.features.checkpoints import build_checkpoints
from megatron.training.features.comms import build_comms_report
from megatron.training.features.hf import build_hf_saves
from megatron.training.features.peft import build_peft_saves
from megatron.training.features.reinit import build_reinit_tokens
from megatron.training.features.stragglers import build_stragglers
from megatron.training.features.stream_state import build_stream_state
from megatron.training.features.tasks import build_tasks
from megatron.training.features.weight_server import build_weight_server
from megatron.training.loop import Hooks, LoopHooks
from megatron.training.train_config import TrainConfig

FeatureBuilder = Callable[[TrainConfig, Setup], LoopHooks | None]

FEATURES: tuple[FeatureBuilder, ...] = (
    build_checkpoints,  # first: a step is committed before its other saves are written (a killed one is redone)
    build_reinit_tokens,  # before the EMA: the average starts at the re-drawn rows
    build_averaging,  # before the tasks and saves that read its weights; updated before the step's checkpoint
    build_bad_steps,
    build_stream_state,  # after_update (before every after_step): the step's checkpoint gets the streams' positions
    build_stragglers,
    build_comms_report,
    build_tasks,
    build_peft_saves,
    build_hf_saves,
    build_weight_server,  # last: after every feature's resume, the live weights are handed out once
)
"""Every feature, in the order of its events: ``resume`` before the first step, ``after_update`` (all before any
``after_step``), ``log_metrics``, ``after_step``, the evaluations, ``at_exit``."""


def build_hooks(run: TrainConfig, setup: Setup, features: Sequence[FeatureBuilder] = FEATURES) -> Hooks:
    """The hooks of the features ``run`` turns on, in order; a feature that keeps weights for evaluation (the EMA)
    hands them to the builders after it (``Setup.eval_weights``)."""
    built: list[LoopHooks] = []
    for build in features:
        hooks = build(run, setup)
        if hooks is None:
            continue
        built.append(hooks)
        if hooks.eval_weights is not None:
            setup = replace(setup, eval_weights=hooks.eval_weights)
    return Hooks(built)
