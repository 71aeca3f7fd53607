"""Parameter, gradient and optimizer-state statistics at log steps (GPT-NeoX's ``log_*`` keys).

- ``log_param_norm``: ``train/param_norm`` and ``param_norm/<name>`` (fp32 master weights).
- ``log_grad_norm``: ``grad_norm/<name>``, each parameter's gradient as the optimizer receives it
  (averaged over data parallelism, before clipping, loss scale removed).
- ``log_grad_pct_zeros``: ``train/grad_pct_zeros`` and ``grad_pct_zeros/<name>``.
- ``log_optimizer_states``: ``optimizer_state/<key>_norm`` and ``optimizer_state/<key>/<name>``
  for each tensor the optimizer keeps per parameter (Adam: ``exp_avg``, ``exp_avg_sq``).

Every value is that of the *full* parameter on any layout: DeepSpeed's ``safe_get_full_*``
accessors assemble ZeRO-partitioned gradients, master weights and optimizer states; tensor-parallel
shards are summed over the tensor-parallel group and each pipeline stage's parameters are gathered,
so rank 0 logs the whole model. Gradients only exist between the backward and the optimizer step
(DeepSpeed frees them inside its step), so they are read in a wrapper around the engine's
``optimizer.step`` (and, for fp32 without ZeRO, around its clipping, which comes first) armed only
before log steps; everything else is read after the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

from megatron import mpu
from megatron.deepspeed_internals import has_partitioned_optimizer_state, relink_optimizer_state_views
from megatron.logging.config import StatsSettings


class StatsCollector:
    def __init__(self, settings: StatsSettings, engine: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
        self._armed = False
        self._linked = False
        self._grads: dict[str, tuple[float, float, float]] | None = None
        if settings.needs_grads:
            self._wrap(engine.optimizer, "step")
            # fp32 without ZeRO clips before the step: read the gradients before the clip
            self._wrap(engine, "clip_fp32_gradients")

    def _wrap(self, owner: Any, method: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self._armed and self._grads is None:
                self._grads = self._grad_stats()
            return inner(*args, **kwargs)

        setattr(owner, method, wrapped)

    def arm(self, log_step: bool) -> None:
        """Call before each step: gradients are read only before steps that will be logged."""
        self._armed = log_step and self.settings.needs_grads
        self._grads = None

    # --- reading full tensors -------------------------------------------------------------------
    def _grad_scale(self) -> float:
        """fp16 gradients carry the loss scale until DeepSpeed's step divides it out."""
        if not self.engine.fp16_enabled():
            return 1.0
        optimizer = self.engine.optimizer
        scale = getattr(optimizer, "cur_scale", None)
        if scale is None:
            scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
        return float(scale) if scale else 1.0

    def _grad_stats(self) -> dict[str, tuple[float, float, float]]:
        scale = self._grad_scale()
        out: dict[str, tuple[float, float, float]] = {}
        for name, p in self.named:
            grad = safe_get_full_grad(p)  # a collective under ZeRO: every rank calls it in order
            if grad is None:
                continue
            g = grad.detach().float()
            out[name] = (float(g.pow(2).sum()) / scale**2, float((g == 0).sum()), float(g.numel()))
        return out

    def _full_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        full = safe_get_full_fp32_param(p)
        return (p if full is None else full).detach().float()

    def _optimizer_states(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        keys = self._state_keys()
        if has_partitioned_optimizer_state(p):
            self._link_optimizer_states()
            out = {}
            for key in keys:
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    out[key] = value.detach().float()
            return out
        state = self.engine.optimizer.state.get(p, {}) if hasattr(self.engine.optimizer, "state") else {}
        return {k: v.detach().float() for k, v in state.items() if torch.is_tensor(v) and v.numel() == p.numel()}

    def _link_optimizer_states(self) -> None:
        """ZeRO-1/2 and the bf16 optimizer keep the states on flat master partitions and link each
        parameter's view of them once, right after the first optimizer step of the *first* param
        group — when the other groups (e.g. no weight decay) have no state yet, so their views
        stay empty (DeepSpeed 0.19.8). Relinking now, once every group has stepped, fixes that."""
        if not self._linked:
            self._linked = relink_optimizer_state_views(self.engine.optimizer)

    def _state_keys(self) -> list[str]:
        basic = self.engine.basic_optimizer if self.engine.basic_optimizer is not None else self.engine.optimizer
        for state in basic.state.values():
            return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1)
        return []

    # --- reduction over tensor and pipeline parallelism -----------------------------------------
    def _reduce(self, local: dict[str, list[float]]) -> dict[str, list[float]]:
        """Per-name sums of additive statistics over the whole model (on every rank)."""
        tp_rank = mpu.get_tensor_model_parallel_rank()
        names = sorted(local)
        if names and mpu.get_tensor_model_parallel_world_size() > 1:
            params = dict(self.named)
            # shards are disjoint: add them up; replicated parameters: count tp rank 0's copy only
            rows = [local[n] if is_model_parallel_parameter(params[n]) or tp_rank == 0 else [0.0] * len(local[n])
                    for n in names]
            group = mpu.get_tensor_model_parallel_group()
            # on the device the backend moves (NCCL refuses a host tensor); read back once, at log steps
            table = torch.tensor(rows, dtype=torch.float64, device=mpu.collective_device(group))
            dist.all_reduce(table, group=group)
            local = {n: row for n, row in zip(names, table.cpu().tolist())}
        if mpu.get_pipe_parallel_world_size() > 1:
            gathered: list[dict[str, list[float]] | None] = [None] * mpu.get_pipe_parallel_world_size()
            dist.all_gather_object(gathered, local, group=mpu.get_pipe_parallel_group())
            merged: dict[str, list[float]] = {}
            for stage in gathered:
                for name, values in (stage or {}).items():
                    merged.setdefault(name, values)  # a tied weight lives on two stages: count once
            local = merged
        return local

    # --- the row --------------------------------------------------------------------------------
    def collect(self) -> dict[str, float]:
        """Metrics for the step just taken; every rank must call it (it runs collectives)."""
        s = self.settings
        row: dict[str, float] = {}
        if s.needs_grads:
            grads = self._reduce({k: list(v) for k, v in (self._grads or {}).items()})
            total_zeros = sum(v[1] for v in grads.values())
            total = sum(v[2] for v in grads.values())
            if s.grad_norm:
                row.update({f"grad_norm/{n}": math.sqrt(v[0]) for n, v in grads.items()})
            if s.grad_pct_zeros and total:
                row["train/grad_pct_zeros"] = 100.0 * total_zeros / total
                row.update({f"grad_pct_zeros/{n}": 100.0 * v[1] / v[2] for n, v in grads.items() if v[2]})
        if s.param_norm:
            params = self._reduce({n: [float(self._full_param(p).pow(2).sum())] for n, p in self.named})
            row["train/param_norm"] = math.sqrt(sum(v[0] for v in params.values()))
            row.update({f"param_norm/{n}": math.sqrt(v[0]) for n, v in params.items()})
        if s.optimizer_states:
            keys = self._state_keys()
            local: dict[str, list[float]] = {}
            for n, p in self.named:
                states = self._optimizer_states(p)
                local[n] = [float(states[k].pow(2).sum()) if k in states else 0.0 for k in keys]
            states_sq = self._reduce(local)
            for i, key in enumerate(keys):
                row[f"optimizer_state/{key}_norm"] = math.sqrt(sum(v[i] for v in states_sq.values()))
                row.update({f"optimizer_state/{key}/{n}": math.sqrt(v[i]) for n, v in states_sq.items()})
        self._armed = False
        self._grads = None
        return row
