"""Where :class:`megatron.training.bad_steps.BadStepRule` decides: inside DeepSpeed's optimizer step.

The step's loss (the mean over the global batch, every data-parallel rank alike) is handed over before the
update (``Engine.before_update``, called by the objective runner before its last ``engine.step()``); the
gradient norm is the one DeepSpeed computed for clipping (``deepspeed_internals.pending_grad_norm``), or,
without a wrapper and without clipping, Deepy's own global norm. Both are the same on every rank, so every
rank takes the same decision and the replicas stay equal. A refused update leaves the weights and the
optimizer's state untouched; the LR scheduler steps as usual (Levanter's schedule count advances too).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.deepspeed_internals import before_optimizer_step, gate_optimizer_update, pending_grad_norm
from megatron.training.bad_steps import BadStepRule, Verdict
from megatron.engine.build import clip_grad_norm


class BadStepGate:
    """The rule wired into one engine; ``last`` is the verdict of the latest step."""

    def __init__(self, engine: Any, rule: BadStepRule) -> None:
        """``engine``: DeepSpeed's engine; the trainer hands :meth:`set_loss` to ``Engine.before_update``."""
        self.rule = rule
        self.engine = engine
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.loss: torch.Tensor | None = None
        self.last: Verdict | None = None
        self._decided = False
        before_optimizer_step(engine, self._new_step)
        gate_optimizer_update(engine, self._allow)

    def set_loss(self, loss: torch.Tensor) -> None:
        """The step's loss, before its update (the same on every rank)."""
        self.loss = loss

    def _new_step(self) -> None:
        self._decided = False

    def _allow(self) -> bool:
        """Called by each of the step's optimizer updates (ZeRO calls one per parameter group): decides once."""
        if not self._decided:
            if self.loss is None:
                raise RuntimeError("skip_bad_steps: the optimizer stepped before the step's loss was known")
            norm = pending_grad_norm(self.engine)
            if norm is None:
                norm = clip_grad_norm(self.params, 0.0)  # measures only
            self.last = self.rule.judge(float(self.loss), norm)
            self._decided = True
            self.loss = None
        assert self.last is not None
        return not self.last.skip
