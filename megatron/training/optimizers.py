"""Optimizers built from the GPT-NeoX ``optimizer: {type: ..., params: {...}}`` config.

Builders live in a registry keyed by the lower-cased ``type`` string. Parameters are split into two
groups: weight decay applies to matrices only, never to biases or normalisation weights (decaying
a LayerNorm gain towards zero only fights the normalisation).

GPT-NeoX's ``Adam`` is apex's FusedAdam in its default AdamW mode (decoupled weight decay), so here
``Adam`` and ``AdamW`` both build :class:`torch.optim.AdamW`; the results match NeoX's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron.errors import ConfigError

ParamGroups = list[dict[str, Any]]
OptimizerBuilder = Callable[[ParamGroups, float, dict[str, Any]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerBuilder] = {}


def register_optimizer(*names: str) -> Callable[[OptimizerBuilder], OptimizerBuilder]:
    def add(fn: OptimizerBuilder) -> OptimizerBuilder:
        for name in names:
            OPTIMIZERS[name.lower()] = fn
        return fn

    return add


# --- parameter groups ------------------------------------------------------------------------
def is_no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases, norm weights and other vectors are not decayed."""
    lowered = name.lower()
    return param.ndim < 2 or lowered.endswith("bias") or "norm" in lowered


def param_groups(model: torch.nn.Module, weight_decay: float) -> ParamGroups:
    """Two groups (decay, no decay); empty groups are dropped because ZeRO rejects them."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if is_no_decay(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


# --- the optimizers --------------------------------------------------------------------------
def _betas(params: dict[str, Any], default: tuple[float, float]) -> tuple[float, float]:
    betas = params.get("betas", default)
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ConfigError(f"optimizer.params.betas={betas!r} must be a list of two floats, e.g. [0.9, 0.95]")
    return float(betas[0]), float(betas[1])


def _check_known(kind: str, params: dict[str, Any], known: Iterable[str]) -> None:
    unknown = sorted(set(params) - set(known) - {"lr"})
    if unknown:
        raise ConfigError(
            f"optimizer.params: {unknown} are not parameters of the {kind} optimizer; "
            f"it accepts {sorted(known)}"
        )


def _fused_supported(groups: ParamGroups) -> bool:
    """torch's fused AdamW kernel exists for CUDA and (torch >= 2.4) CPU float tensors."""
    tensors = [p for g in groups for p in g["params"]]
    return bool(tensors) and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in tensors)


@register_optimizer("adam", "adamw", "cpu_torch_adam")
def build_adamw(groups: ParamGroups, lr: float, params: dict[str, Any]) -> torch.optim.Optimizer:
    _check_known("Adam", params, ["betas", "eps", "amsgrad"])
    kwargs = dict(lr=lr, betas=_betas(params, (0.9, 0.999)), eps=float(params.get("eps", 1e-8)),
                  amsgrad=bool(params.get("amsgrad", False)))
    if _fused_supported(groups):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # an older torch without the fused kernel on this device: foreach is next best
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


@register_optimizer("cpu_adam", "cpuadam")
def build_cpu_adam(groups: ParamGroups, lr: float, params: dict[str, Any]) -> torch.optim.Optimizer:
    _check_known("CPU_Adam", params, ["betas", "eps", "amsgrad"])
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=_betas(params, (0.9, 0.999)),
                                eps=float(params.get("eps", 1e-8)), adamw_mode=True,
                                amsgrad=bool(params.get("amsgrad", False)))
    except Exception as err:  # the op is JIT-built: any failure there is an environment problem
        raise ConfigError(
            f"optimizer.type=CPU_Adam needs DeepSpeed's cpu_adam C++ op, which could not be built or "
            f"loaded ({type(err).__name__}: {err}). Install a C++ compiler and ninja, or pre-build it "
            f"with DS_BUILD_CPU_ADAM=1 pip install deepspeed, or use optimizer.type=AdamW"
        ) from err


@register_optimizer("sgd")
def build_sgd(groups: ParamGroups, lr: float, params: dict[str, Any]) -> torch.optim.Optimizer:
    _check_known("SGD", params, ["momentum", "dampening", "nesterov"])
    return torch.optim.SGD(groups, lr=lr, momentum=float(params.get("momentum", 0.0)),
                           dampening=float(params.get("dampening", 0.0)),
                           nesterov=bool(params.get("nesterov", False)))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    The update is the sign of an interpolation between the momentum and the gradient, so every
    coordinate moves by exactly ``lr``; it keeps one state tensor (Adam keeps two).
    """

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ConfigError(f"Lion: lr={lr} must be positive")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                if wd:
                    p.mul_(1.0 - lr * wd)  # decoupled, as in AdamW
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1.0 - beta2)
        return loss


@register_optimizer("lion")
def build_lion(groups: ParamGroups, lr: float, params: dict[str, Any]) -> torch.optim.Optimizer:
    _check_known("Lion", params, ["betas"])
    return Lion(groups, lr=lr, betas=_betas(params, (0.9, 0.99)))


# --- from the config ---------------------------------------------------------------------------
def optimizer_settings(args: Any) -> tuple[str, dict[str, Any], float]:
    """(type, params without lr, lr) from ``args.optimizer`` (a dict or an object with type/params)."""
    spec = getattr(args, "optimizer", None)
    if spec is None:
        # the flat GPT-NeoX alternative to the optimizer block
        kind, params = getattr(args, "optimizer_type", None) or "adam", {}
    elif isinstance(spec, dict):
        kind, params = spec.get("type", "adamw"), dict(spec.get("params") or {})
    else:
        kind, params = getattr(spec, "type", "adamw"), dict(getattr(spec, "params", None) or {})
    lr = getattr(args, "lr", None)
    if lr is None:
        lr = params.get("lr")
    if lr is None:
        raise ConfigError("no learning rate: set optimizer.params.lr (or lr)")
    params.pop("lr", None)
    params.pop("weight_decay", None)  # taken from the top-level weight_decay per group
    return str(kind), params, float(lr)


def build_optimizer(model: torch.nn.Module, args: Any, offload: bool = False) -> torch.optim.Optimizer:
    """``offload``: ZeRO keeps the optimizer state on the CPU (``offload_optimizer``), where
    DeepSpeed requires its own CPU Adam; Adam/AdamW are switched to it (same update rule)."""
    kind, params, lr = optimizer_settings(args)
    if offload and kind.lower() in ("adam", "adamw", "cpu_torch_adam"):
        kind = "cpu_adam"
    builder = OPTIMIZERS.get(kind.lower())
    if builder is None:
        raise ConfigError(
            f"optimizer.type={kind!r} is not available; choose one of "
            f"{sorted({'Adam', 'AdamW', 'CPU_Adam', 'Lion', 'SGD'})}"
        )
    weight_decay = float(getattr(args, "weight_decay", 0.0) or 0.0)
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters")
    return builder(groups, lr, params)
