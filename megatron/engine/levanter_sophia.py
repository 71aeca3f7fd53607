"""Levanter's Sophia-H: its update (:class:`LevanterSophiaH`) and its Hutchinson estimate of the Hessian diagonal
every ``update_interval`` steps (:class:`HessianProbe`, run by the trainer's step).

Read from stanford-crfm/levanter at 9263f81e, ``src/levanter/optim/sophia.py``. ``_sophia_gradient_transform``
(sophia.py:305-390), with ``t`` the steps taken before this one (``state.count``) and ``g`` the (clipped) gradient::

    mu = b1 * mu + (1 - b1) * g
    u  = clip(mu / (1 - b1**(t + 1)) / max(gamma * h, eps), -clip_threshold, clip_threshold)
    t  = t + 1
    if t % update_interval == 0:                   # update_hessian (sophia.py:367-388)
        h = b2 * h + (1 - b2) * z * (H z)          # z ~ N(0, I), H the loss's Hessian at the weights u was
                                                   # computed at, on the step's batch (trainer.py:562-568)

then ``add_decayed_weights(weight_decay, mask)`` and ``scale(-lr)`` (sophia.py:150-178): ``p <- p - lr * (u + wd * p)``.
``h`` starts at zero, so until the first estimate ``u = clip(mu_hat / eps)``: a clipped sign of the momentum.

Here the estimate ``z * (H z)`` is measured before the optimizer step it belongs to (the weights are then those
``u`` is computed at), handed to the optimizer's state as ``hessian_estimate`` after that step, and folded into
``h`` at the start of the next step, before ``h`` is read again: the same numbers as Levanter's order, and a
checkpoint taken between the two steps holds the estimate (resume is exact).

Where the weights live: without ZeRO the optimizer steps the model's own parameters; under ZeRO-1/2 (and
DeepSpeed's bf16 optimizer) each rank steps its shard of a flat fp32 copy, and the estimate of each model
parameter is written into the shard through DeepSpeed's ``safe_set_full_optimizer_state`` (its fragment mapping,
``deepspeed/utils/tensor_fragment.py`` in DeepSpeed 0.19.8). Every rank draws the same ``z`` (a CPU generator
seeded with ``rng_seed`` and the estimate's index) and sums its share of the global-batch loss's ``z * (H z)`` over
the data-parallel ranks, so the estimate is that of the whole batch, as Levanter's. Levanter draws ``z`` from JAX's
generator: the numbers differ, the distribution is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron import mpu
from megatron.deepspeed_internals import (has_partitioned_optimizer_state, relink_optimizer_state_views,
                                         zero3_params_held)
from megatron.engine.levanter_optim import closure_loss
from megatron.engine.whole_parameters import tp_own, tp_split
from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

SOPHIA_ESTIMATE = "hessian_estimate"
"""The optimizer-state key the probe writes the latest ``z * (H z)`` into."""


class LevanterSophiaH(torch.optim.Optimizer):
    """Levanter's ``SophiaHConfig`` update (module docstring). State per parameter: ``step`` (Levanter's
    ``count``), ``mu``, ``h`` and the latest ``hessian_estimate``."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float, gamma: float,
                 clip_threshold: float | None, update_interval: int, weight_decay: float = 0.0) -> None:
        if update_interval < 1:
            raise ValueError(f"update_interval must be at least 1, not {update_interval}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "gamma": gamma,
                                  "clip_threshold": clip_threshold, "update_interval": update_interval,
                                  "weight_decay": weight_decay})

    @property
    def steps_taken(self) -> int:
        """Levanter's ``count``: steps taken so far (0 before the first)."""
        return max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)

    @property
    def update_interval(self) -> int:
        return int(self.defaults["update_interval"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, decay, clip = group["lr"], group["weight_decay"], group["clip_threshold"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["mu"] = torch.zeros_like(param)
                    state["h"] = torch.zeros_like(param)
                    state[SOPHIA_ESTIMATE] = torch.zeros_like(param)
                t = int(state["step"])
                mu, h = state["mu"], state["h"]
                if t > 0 and t % group["update_interval"] == 0:  # the estimate measured at step t (update_hessian)
                    h.mul_(b2).add_(state[SOPHIA_ESTIMATE], alpha=1.0 - b2)
                mu.mul_(b1).add_(param.grad, alpha=1.0 - b1)
                update = (mu / (1.0 - b1 ** (t + 1))) / torch.clamp(h * group["gamma"], min=group["eps"])
                if clip is not None:
                    update.clamp_(-clip, clip)
                if decay:
                    param.mul_(1.0 - lr * decay)
                param.add_(update, alpha=-lr)
                state["step"] = t + 1
        return loss


def base_sophia(optimizer: Any) -> LevanterSophiaH | None:
    """The :class:`LevanterSophiaH` inside DeepSpeed's wrappers (ZeRO, bf16: each keeps it as ``.optimizer``)."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, LevanterSophiaH):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def fp32_masters(optimizer: Any) -> dict[torch.Tensor, torch.Tensor]:
    """Model parameter -> the fp32 master DeepSpeed's ``FP16_UnfusedOptimizer`` steps for it (fp16, and bf16 without a
    pipeline, at ZeRO 0: one fp32 copy per parameter, ``fp16_groups``/``fp32_groups`` in step, DeepSpeed 0.19.8
    ``runtime/fp16/unfused_optimizer.py``); empty for any other wrapper (the flat ones are refused or mapped by
    ``_hp_mapping``)."""
    lows, highs = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if lows is None or highs is None or hasattr(optimizer, "fp32_groups_flat"):
        return {}
    return {low: high for low_group, high_group in zip(lows, highs) for low, high in zip(low_group, high_group)}


def gaussian_probe(params: list[torch.nn.Parameter], seed: int, index: int) -> list[torch.Tensor]:
    """The ``index``-th draw of ``z``: one standard normal tensor per whole parameter, the same on every rank; a
    tensor-parallel rank keeps its slice of a split one (so ``z`` does not depend on the tp size)."""
    generator = torch.Generator().manual_seed((seed << 32) + index)
    draws = []
    for p in params:
        split = tp_split(p)
        shape = list(p.shape)
        if split is not None:
            shape[split[0]] *= mpu.get_tensor_model_parallel_world_size()
        whole = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
        draws.append(tp_own(whole, split).to(p.device, p.dtype))
    return draws


class HessianProbe:
    """Measures ``z * (H z)`` before the optimizer step whose (post-step) count is a multiple of
    ``update_interval`` and writes it into the optimizer's state after that step (module docstring).

    ``model``: the module whose trainable parameters the loss is differentiated by; ``optimizer``: what the engine
    steps (a DeepSpeed wrapper or the optimizer itself); ``suspend_recompute``: a context in which activation
    checkpointing runs its blocks plainly (a reentrant checkpoint cannot be differentiated twice)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, seed: int,
                 suspend_recompute: Callable[[], Any] | None = None) -> None:
        sophia = base_sophia(optimizer)
        if sophia is None:
            raise TypeError("the Hessian probe needs Levanter's Sophia-H optimizer")
        self.sophia = sophia
        self.wrapper = optimizer
        self.masters = fp32_masters(optimizer)
        if self.masters:
            # DeepSpeed's unfused mixed-precision wrapper takes one step with zero gradients when it is built
            # (unfused_optimizer.py:108,412-433 in 0.19.8) to create the state: that is not a training step, and
            # Sophia's count (the bias correction, when the Hessian is due) must not include it
            self.sophia.state.clear()
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model = model
        self.seed = seed
        self.suspend_recompute = suspend_recompute
        self._pending: list[torch.Tensor] | None = None

    def due(self) -> bool:
        """The step about to be taken ends on a multiple of ``update_interval``."""
        return (self.sophia.steps_taken + 1) % self.sophia.update_interval == 0

    def measure(self, losses: Callable[[], Iterator[torch.Tensor]]) -> None:
        """``losses``: the step's micro-batch losses, each its share of the global-batch loss, recomputed at the
        current weights (their sum over micro-batches and data-parallel ranks is the step's loss)."""
        params = [p for _, p in self.named]
        with zero3_params_held(params):  # ZeRO-3: every weight whole until both differentiations are done
            self._measure(params, losses)

    def _measure(self, params: list[torch.nn.Parameter], losses: Callable[[], Iterator[torch.Tensor]]) -> None:
        index = (self.sophia.steps_taken + 1) // self.sophia.update_interval - 1
        z = gaussian_probe(params, self.seed, index)
        splits = [tp_split(p) for p in params]
        partial = {id(p) for p in partial_over_tensor_parallel(self.model)}
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        context = self.suspend_recompute() if self.suspend_recompute is not None else contextlib.nullcontext()
        # torch's math attention: its flash and memory-efficient kernels have no second derivative
        with torch.enable_grad(), context, sdpa_kernel([SDPBackend.MATH]):
            for loss in losses():
                grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
                # g.z over the whole model: a split parameter's slices, and a replicated parameter's partial
                # gradients (mpu.layers.partial_over_tensor_parallel: norms under sequence parallelism, per-head q/k
                # norms), summed over the tp ranks (a differentiable all-reduce, mpu.mappings); the other replicated
                # ones' (the same on every tp rank) counted once
                terms = [((g * v).sum(), split is not None or id(p) in partial)
                         for g, v, split, p in zip(grads, z, splits, params) if g is not None]
                zero = torch.zeros((), device=loss.device)
                dot = sum((t for t, is_split in terms if not is_split), zero)
                if any(is_split for _, is_split in terms):
                    dot = dot + mpu.reduce_from_tensor_model_parallel_region(
                        sum((t for t, is_split in terms if is_split), zero))
                if not dot.requires_grad:
                    continue
                hz = torch.autograd.grad(dot, params, allow_unused=True)
                for acc, product in zip(total, hz):
                    if product is not None:
                        acc.add_(product.float())
        # a partial parameter's H z is partial too: summed over the tp ranks, as its gradient is at the step
        sum_partial_grads_over_tensor_parallel([acc for acc, p in zip(total, params) if id(p) in partial])
        if mpu.get_data_parallel_world_size() > 1:
            for acc in total:
                dist.all_reduce(acc, group=mpu.get_data_parallel_group())
        self._pending = [acc * v.float() for acc, v in zip(total, z)]

    def deliver(self) -> None:
        """After the optimizer step: the measured estimate into the optimizer's ``hessian_estimate`` state."""
        if self._pending is None:
            return
        # lazy: DeepSpeed's public setter of a parameter's partitioned optimizer state, used here only
        from deepspeed.utils import safe_set_full_optimizer_state

        # DeepSpeed 0.19.8 links the state views after the first group's first step, before the other groups
        # have state: linked again now that every group has stepped (deepspeed_internals)
        relink_optimizer_state_views(self.wrapper)
        for (name, param), estimate in zip(self.named, self._pending):
            if has_partitioned_optimizer_state(param):  # ZeRO-1/2, bf16: this rank's fragment of the flat shard
                safe_set_full_optimizer_state(param, estimate, SOPHIA_ESTIMATE)
            elif SOPHIA_ESTIMATE in self.sophia.state.get(self.masters.get(param, param), {}):
                self.sophia.state[self.masters.get(param, param)][SOPHIA_ESTIMATE].copy_(estimate)
            else:
                raise RuntimeError(f"Sophia-H: no optimizer state for {name}: the optimizer does not step the "
                                   "model's parameters, nor DeepSpeed's ZeRO/bf16 shards of them")
        self._pending = None
