"""``skip_bad_steps_window`` as a feature: the bad-step rule decides inside each optimizer step (``BadStepGate``,
told the step's loss before the update), its window is saved in every checkpoint (``TrainState.bad_steps``) and read
back when the run resumes, and the log rows count the steps it skipped (``train/skipped_bad_steps``)."""

from __future__ import annotations

from megatron.engine.build import Engine
from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks, TrainState
from megatron.training.train_config import TrainConfig
from megatron.training.skip_gate import BadStepGate


def build_bad_steps(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None without ``skip_bad_steps_window``."""
    rule = run.bad_steps.bad_step_rule()
    if rule is None:
        return None
    gate = BadStepGate(setup.eng.engine, rule)

    def resume(_eng: Engine, state: TrainState) -> None:
        rule.restore(state.bad_steps)

    def after_update(_eng: Engine, state: TrainState) -> None:
        state.bad_steps = rule.to_dict()  # before the step's checkpoint, which stores it

    return LoopHooks(name="skip_bad_steps", resume=resume, before_update=gate.set_loss, after_update=after_update,
                     log_metrics=lambda _eng, _state: {"train/skipped_bad_steps": rule.skipped})
