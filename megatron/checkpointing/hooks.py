"""The training loop's checkpoint hooks, wired explicitly by ``pretrain``.

``CheckpointHooks(manager)`` offers ``load(eng, state)`` before the loop, ``after_step(eng, state)``
after every optimizer step (returns True to stop: preemption) and ``at_exit(eng, state)`` once at
the end. ``validate`` (``checkpoint_validation_with_forward_pass``) is a function computing the loss
of a fixed batch: after every save the weights just written are read back into the engine and that
loss must not change.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from megatron.checkpointing import commit
from megatron.checkpointing.manager import CheckpointManager
from megatron.checkpointing.save_load import LoadOptions, load_checkpoint
from megatron.checkpointing.universal import universal_checkpoint_info
from megatron.errors import CheckpointError

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks


class CheckpointHooks:
    def __init__(self, manager: CheckpointManager, validate: Callable[[], float] | None = None,
                 reseed: Callable[[int], None] | None = None) -> None:
        """``reseed(iteration)``: seeds fresh RNG streams when a resume cannot restore the saved ones
        (the tp/pp/dp split changed), so the run does not replay the dropout masks of its first steps."""
        self.manager = manager
        self.validate = validate
        self.reseed = reseed

    def attach_model(self, eng: Any, tp: int) -> None:
        """Record how the model's tensors split over tp, so later loads can change the layout."""
        self.manager.universal_info = universal_checkpoint_info(eng.config, tp)

    def load(self, eng: Any, state: Any) -> Any:
        """Restore the engine and return the loop's state (the given one when nothing was loaded)."""
        result = self.manager.load(eng.engine)
        if not result.loaded:
            return state
        if result.iteration == 0 and result.consumed_samples == 0:
            return state  # weights only (finetune / initialize_from): progress starts at zero
        if not result.rng_restored and not self.manager.no_load_rng and self.reseed is not None:
            self.reseed(result.iteration)
        saved = dict(result.extra.get("train_state") or {})
        saved.update(iteration=result.iteration, consumed_samples=result.consumed_samples, stop_reason=None)
        return type(state).from_dict({**state.to_dict(), **saved})

    def after_step(self, eng: Any, state: Any) -> bool:
        before = self.manager.last_saved_step
        outcome = self.manager.maybe_save(
            eng.engine, state.iteration, state.consumed_samples, extra={"train_state": state.to_dict()}
        )
        if outcome.saved and self.manager.last_saved_step != before:
            self._check_reload(eng, state.iteration)
        if outcome.stop:
            state.stop_reason = f"preempted ({self.manager.preemption.signal_name}); checkpoint saved"
        return outcome.stop

    def at_exit(self, eng: Any, state: Any) -> None:
        """Save when the loop ended early (exit_interval) and the last step is not on disk yet."""
        manager = self.manager
        if manager.save_dir is None or manager.last_saved_step == state.iteration or state.iteration == 0:
            return
        manager.save(eng.engine, state.iteration, state.consumed_samples, "step",
                     extra={"train_state": state.to_dict()})
        self._check_reload(eng, state.iteration)

    def _check_reload(self, eng: Any, step: int) -> None:
        if self.validate is None or self.manager.save_dir is None:
            return
        before = self.validate()
        ckpt_dir = self.manager.save_dir / commit.tag_for(step)
        load_checkpoint(eng.engine, ckpt_dir, self.manager.args_dict, LoadOptions(weights_only=True))
        after = self.validate()
        if not (math.isfinite(before) and after == before):
            raise CheckpointError(
                f"checkpoint_validation_with_forward_pass: {ckpt_dir} does not reproduce the model: the "
                f"loss of the validation batch was {before!r} before saving and {after!r} after reading "
                f"the saved weights back"
            )
        log.info("checkpoint %s validated: reloaded weights give the same loss (%.6f)", ckpt_dir.name, after)
