"""Levanter's ADOPT and RMSProp-with-momentum as torch optimizers, their updates exactly as Levanter writes them.

Read from stanford-crfm/levanter at 9263f81e. Both are element-wise, so under ZeRO (each rank steps its
shard of the flat fp32 master) and tensor parallelism (each rank steps its slice) they need nothing
gathered (tests/distributed/test_levanter_optimizers_zero.py: ZeRO-1 and ZeRO-3 at dp2 equal ZeRO-0).
Levanter chains ``clip_by_global_norm(max_grad_norm)`` (DeepSpeed's ``gradient_clipping`` here), the
transformation below, ``add_decayed_weights(weight_decay, mask)`` and ``scale(-lr)``: so
``p <- p - lr * (u + wd * p)``, which is ``p <- p * (1 - lr * wd) - lr * u`` (the decay is the group's
``weight_decay``; the mask is Deepy's decay/no-decay groups).

**ADOPT** (``scale_by_adopt``, ``src/levanter/optim/adopt.py:65-131``), with ``t`` the steps taken before this
one (``state.count``)::

    u_adam = 0                                  if t == 0
             g / (sqrt(nu / (1 - b2**t)) + eps) otherwise (nu from before this step)
    mu = b1 * mu + (1 - b1) * u_adam
    nu = b2 * nu + (1 - b2) * g**2
    u  = mu / (1 - b1**(t + 1))

pytorch-optimizer 4.1.0's ``ADOPT`` (the paper's algorithm) is not this, so it is not used: it seeds the
second moment with ``g0**2`` and never bias-corrects it (Levanter: ``(1-b2) g0**2`` then divides by
``1 - b2**t``), takes ``max(sqrt(v), eps)`` (Levanter: ``sqrt(v_hat) + eps``), clips the normalised gradient
to ``±step**0.25`` (Levanter: no clip), and does not bias-correct the momentum (Levanter divides by
``1 - b1**(t+1)``); its first step changes nothing but the decay, as Levanter's does.

**RMSProp with momentum** (``scale_by_rmsprop_momentum``, ``src/levanter/optim/rmsprop.py:65-136``), ``t`` counted
from 1::

    v = b2 * v + (1 - b2) * g**2
    m = b1 * m + (1 - b1) * g / (sqrt(v / (1 - b2**t)) + eps)
    u = m / (1 - b1**t)

``torch.optim.RMSprop`` is not this, so it is not used: it bias-corrects neither average and its momentum
buffer is undamped (``buf = momentum * buf + g / (sqrt(v) + eps)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """``torch.optim``'s closure convention, which every ``step`` here keeps: the loss the closure computes with
    gradients on, None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class LevanterOptimizer(torch.optim.Optimizer):
    """State per parameter: ``step`` (Levanter's ``count``) and two buffers in the parameter's dtype."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _direction(self, grad: torch.Tensor, state: dict[str, Any], b1: float, b2: float,
                   eps: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["mu"] = torch.zeros_like(param)
                    state["nu"] = torch.zeros_like(param)
                update = self._direction(param.grad, state, b1, b2, group["eps"])
                if decay:
                    param.mul_(1.0 - lr * decay)
                param.add_(update, alpha=-lr)
        return loss


class LevanterAdopt(LevanterOptimizer):
    """Levanter's ``scale_by_adopt`` (module docstring)."""

    def _direction(self, grad: torch.Tensor, state: dict[str, Any], b1: float, b2: float,
                   eps: float) -> torch.Tensor:
        t = state["step"]
        mu, nu = state["mu"], state["nu"]
        if t > 0:  # the first step's adam_updates are zeros (adopt.py:101-123)
            adam = grad / ((nu / (1.0 - b2**t)).sqrt() + eps)
            mu.mul_(b1).add_(adam, alpha=1.0 - b1)
        else:
            mu.mul_(b1)
        nu.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        state["step"] = t + 1
        return mu / (1.0 - b1 ** (t + 1))


class LevanterRMSPropMomentum(LevanterOptimizer):
    """Levanter's ``scale_by_rmsprop_momentum`` (module docstring); ``nu`` is its mean square, ``mu`` its momentum."""

    def _direction(self, grad: torch.Tensor, state: dict[str, Any], b1: float, b2: float,
                   eps: float) -> torch.Tensor:
        t = state["step"] + 1
        mu, nu = state["mu"], state["nu"]
        nu.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        mu.mul_(b1).add_(grad / ((nu / (1.0 - b2**t)).sqrt() + eps), alpha=1.0 - b1)
        state["step"] = t
        return mu / (1.0 - b1**t)
