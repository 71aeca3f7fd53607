"""The three functions ``megatron.training.pretrain`` looks up on ``megatron.checkpointing``.

``load(eng, state, args)`` before the loop, ``maybe_save(eng, state, args)`` after every step
(returns True to stop: preemption), ``save_at_exit(eng, state, args)`` once at the end. They keep
one :class:`CheckpointManager` per process, built from the arguments on first use, so the
preemption handler is installed before the first step.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron.checkpointing.manager import CheckpointManager
from megatron.checkpointing.universal import universal_checkpoint_info

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

_MANAGER: CheckpointManager | None = None


def manager_for(args: Any, eng: Any = None) -> CheckpointManager:
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = CheckpointManager.from_args(args)
    if _MANAGER.universal_info is None and eng is not None and getattr(eng, "config", None) is not None:
        _MANAGER.universal_info = universal_checkpoint_info(eng.config)
    return _MANAGER


def reset() -> None:
    """Forget the manager (tests that run several trainings in one process)."""
    global _MANAGER
    if _MANAGER is not None:
        _MANAGER.preemption.uninstall()
    _MANAGER = None


def load(eng: Any, state: Any, args: Any) -> Any:
    """Restore the engine and return the loop's state (a fresh one when nothing was loaded)."""
    result = manager_for(args, eng).load(eng.engine)
    if not result.loaded:
        return state
    if result.iteration == 0 and result.consumed_samples == 0:
        return state  # weights only (finetune / initialize_from): progress starts at zero
    saved = dict(result.extra.get("train_state") or {})
    saved.update(iteration=result.iteration, consumed_samples=result.consumed_samples, stop_reason=None)
    restored = type(state).from_dict({**state.to_dict(), **saved})
    args.iteration = restored.iteration
    return restored


def maybe_save(eng: Any, state: Any, args: Any) -> bool:
    outcome = manager_for(args, eng).maybe_save(
        eng.engine, state.iteration, state.consumed_samples, extra={"train_state": state.to_dict()}
    )
    if outcome.stop:
        state.stop_reason = f"preempted ({manager_for(args).preemption.signal_name}); checkpoint saved"
    return outcome.stop


def save_at_exit(eng: Any, state: Any, args: Any) -> None:
    """Save when the loop ended early (exit_interval) and the last step is not on disk yet."""
    manager = manager_for(args, eng)
    if manager.save_dir is None or manager.last_saved_step == state.iteration or state.iteration == 0:
        return
    manager.save(eng.engine, state.iteration, state.consumed_samples, "step", extra={"train_state": state.to_dict()})
