"""Optimizers built from the optimizer keys (:class:`~megatron.engine.optimizer_config.OptimizerArgs`).

Builders live in a registry keyed by the optimizer kind (``OPTIMIZER_KINDS`` in the schema maps the
user's type, case-insensitively, to a kind). Parameters are split into two groups: weight decay
applies to matrices only, never to biases or normalisation weights (decaying a LayerNorm gain
towards zero only fights the normalisation). Weight decay is decoupled (AdamW-style) except for SGD,
whose decay is torch's L2 term as in GPT-NeoX.

* ``Adam``/``AdamW``/``CPU_torch_adam``: :class:`torch.optim.AdamW` (fused where the device has the
  kernel). GPT-NeoX's ``Adam`` is apex's FusedAdam in its AdamW mode, so the results match.
* ``CPU_Adam``: DeepSpeed's ``DeepSpeedCPUAdam`` (also what ZeRO-Offload requires for Adam).
* ``SM3``, ``madgrad_wd`` (MADGRAD with decoupled decay) and ``Lion``: the well-kept
  ``pytorch-optimizer`` package.
* ``ADOPT`` and ``RMSPropMomentum``: Levanter's updates (``megatron/engine/levanter_optim.py``; neither
  pytorch-optimizer's ADOPT nor ``torch.optim.RMSprop`` computes them), decoupled decay as Levanter's
  ``add_decayed_weights``.
* ``SophiaH``: Levanter's Sophia-H (``megatron/engine/levanter_sophia.py``), its Hessian-diagonal estimate
  measured by the trainer's step every ``update_interval`` steps.
* ``Muon``, ``Scion``, ``MARS`` and ``Cautious``: Levanter's updates
  (``megatron/engine/levanter_whole_tensor_optim.py``; not ``torch.optim.Muon``, whose Newton-Schulz runs in
  bfloat16). They act on whole tensors (matrices, global norms, a mask's mean over a weight in every layer), so
  their builders are handed the parameters' names (and tp splits), and ZeRO is refused before launch.
* ``SOAP``: Levanter's SOAP (``megatron/engine/levanter_soap.py``): Adam in the eigenbasis of Shampoo's
  preconditioners, on whole (merged, blocked) parameters.
* ``AdamMini``: Levanter's Adam-mini (``megatron/engine/levanter_adam_mini.py``): one second moment per block
  (a vocabulary row, a kv head's query or key rows, an output row), AdamW clipped apart for the rest; its builder
  is handed the names and the attentions' head layouts.
* ``Kron``: Levanter's PSGD Kron (``megatron/engine/levanter_kron.py``): Kronecker-factored preconditioners
  on whole (merged, blocked) parameters, fitted from Gaussian probes.
* ``OneBitAdam``: built by DeepSpeed itself (it needs the engine's communication backend), so it
  only runs on GPUs with NCCL/MPI; the config rules refuse it elsewhere before launch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron.errors import ConfigError
from megatron.engine.bnb import build_adam8bit
from megatron.engine.levanter_adam_mini import HeadLayout, LevanterAdamMini, mini_groups, qkv_head_layouts
from megatron.engine.levanter_kron import LevanterKron
from megatron.engine.levanter_optim import LevanterAdopt, LevanterRMSPropMomentum
from megatron.engine.levanter_whole_tensor_optim import (LevanterCautious, LevanterMars, LevanterMuon, LevanterScion,
                                                         is_linear_matrix, merge_groups, split_groups)
from megatron.engine.levanter_soap import LevanterSoap
from megatron.engine.levanter_sophia import LevanterSophiaH
from megatron.engine.optimizer_config import OptimizerArgs

ParamGroups = list[dict[str, Any]]
OptimizerBuilder = Callable[[ParamGroups, OptimizerArgs], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerBuilder] = {}
DEEPSPEED_BUILT = frozenset({"onebitadam"})
"""Kinds DeepSpeed constructs from its config's ``optimizer`` block."""


Names = Mapping[torch.Tensor, str]
NamedOptimizerBuilder = Callable[[ParamGroups, OptimizerArgs, Names], torch.optim.Optimizer]
NAMED_OPTIMIZERS: dict[str, NamedOptimizerBuilder] = {}
"""Kinds whose update depends on what each parameter is (a linear layer's matrix, the same weight in every layer):
their builders are also handed each parameter's name in the model."""


def register_named_optimizer(kind: str) -> Callable[[NamedOptimizerBuilder], NamedOptimizerBuilder]:
    def add(fn: NamedOptimizerBuilder) -> NamedOptimizerBuilder:
        NAMED_OPTIMIZERS[kind] = fn
        return fn

    return add


def register_optimizer(kind: str) -> Callable[[OptimizerBuilder], OptimizerBuilder]:
    def add(fn: OptimizerBuilder) -> OptimizerBuilder:
        OPTIMIZERS[kind] = fn
        return fn

    return add


# --- parameter groups ------------------------------------------------------------------------
def is_no_decay(name: str, param: torch.nn.Parameter, decay_embeddings: bool = True) -> bool:
    """Biases, norm weights and other vectors are not decayed, nor what a layer marks ``no_weight_decay``
    (GPT-NeoX's ``_no_weight_decay``: Mamba's A_log and D); nor, when ``decay_embeddings`` is false, the
    token and position embeddings (Levanter's default mask; an untied output layer is decayed, a tied one
    is the embedding)."""
    lowered = name.lower()
    # built under deepspeed.zero.Init (zero_init) a parameter is an empty 1-d placeholder until
    # gathered: its real shape is DeepSpeed's ds_shape (else every matrix would skip weight decay)
    shape = getattr(param, "ds_shape", param.shape)
    if not decay_embeddings and "_embeddings" in lowered:
        return True
    flagged = bool(getattr(param, "no_weight_decay", False))
    return len(shape) < 2 or lowered.endswith("bias") or "norm" in lowered or flagged


def param_groups(model: torch.nn.Module, weight_decay: float, decay_embeddings: bool = True) -> ParamGroups:
    """Two groups (decay, no decay); empty groups are dropped because ZeRO rejects them."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if is_no_decay(name, param, decay_embeddings) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


# --- the optimizers --------------------------------------------------------------------------
def _fused_supported(groups: ParamGroups) -> bool:
    """torch's fused AdamW kernel exists for CUDA and (torch >= 2.4) CPU float tensors."""
    tensors = [p for g in groups for p in g["params"]]
    return bool(tensors) and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in tensors)


@register_optimizer("adam")
def build_adamw(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    if cfg.use_bnb_optimizer:
        return build_adam8bit(groups, cfg)
    p = cfg.optimizer_params
    kwargs = dict(lr=cfg.peak_lr, betas=tuple(p["betas"]), eps=p["eps"], amsgrad=p["amsgrad"])
    if _fused_supported(groups):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # an older torch without the fused kernel on this device: foreach is next best
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


@register_optimizer("cpu_adam")
def build_cpu_adam(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    kwargs = dict(lr=cfg.peak_lr, betas=tuple(p["betas"]), eps=p["eps"], adamw_mode=True, amsgrad=p["amsgrad"])
    try:
        # lazy: DeepSpeed's CPU Adam builds a C++ op on first import: only for cpu_adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, **kwargs)
    except Exception as err:  # the op is JIT-built: any failure there is an environment problem
        raise ConfigError(
            f"optimizer.type={cfg.optimizer_type_shown} needs DeepSpeed's cpu_adam C++ op, which could not be "
            f"built or "
            f"loaded ({type(err).__name__}: {err}). Install a C++ compiler and ninja, or pre-build it "
            f"with DS_BUILD_CPU_ADAM=1 pip install deepspeed, or use optimizer.type=AdamW"
        ) from err


@register_optimizer("sgd")
def build_sgd(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    # the groups' weight_decay is torch SGD's own (L2 added to the gradient), as in GPT-NeoX
    return torch.optim.SGD(groups, lr=cfg.peak_lr, momentum=p["momentum"], dampening=p["dampening"],
                           nesterov=p["nesterov"])


@register_optimizer("lion")
def build_lion(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    # lazy: pytorch-optimizer is optional (lion, madgrad_wd, sm3) and imports transformers
    from pytorch_optimizer import Lion

    return Lion(groups, lr=cfg.peak_lr, betas=tuple(cfg.optimizer_params["betas"]), weight_decouple=True)


@register_optimizer("madgrad_wd")
def build_madgrad_wd(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    # lazy: pytorch-optimizer is optional (lion, madgrad_wd, sm3) and imports transformers
    from pytorch_optimizer import MADGRAD

    # GPT-NeoX's madgrad_wd: MADGRAD with AdamW-style (decoupled) weight decay
    p = cfg.optimizer_params
    return MADGRAD(groups, lr=cfg.peak_lr, momentum=p["momentum"], eps=p["eps"], weight_decouple=True)


@register_optimizer("sm3")
def build_sm3(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    # lazy: pytorch-optimizer is optional (lion, madgrad_wd, sm3) and imports transformers
    from pytorch_optimizer import SM3

    p = cfg.optimizer_params
    return _DecoupledDecay.wrap(SM3)(groups, lr=cfg.peak_lr, momentum=p["momentum"], beta=p["beta"], eps=p["eps"])


@register_optimizer("adopt")
def build_adopt(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterAdopt(groups, lr=cfg.peak_lr, betas=tuple(p["betas"]), eps=p["eps"])


@register_optimizer("rmsprop_momentum")
def build_rmsprop_momentum(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterRMSPropMomentum(groups, lr=cfg.peak_lr, betas=tuple(p["betas"]), eps=p["eps"])


@register_optimizer("sophia_h")
def build_sophia_h(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    # its Hessian estimate comes from the trainer's step (HessianProbe, megatron/engine/levanter_sophia.py)
    p = cfg.optimizer_params
    return LevanterSophiaH(groups, lr=cfg.peak_lr, betas=tuple(p["betas"]), eps=p["eps"], gamma=p["gamma"],
                           clip_threshold=p["clip_threshold"], update_interval=p["update_interval"])


def _linear_role(first: str, rest: str) -> Callable[[str, torch.Tensor], str]:
    return lambda name, param: first if is_linear_matrix(name, param) else rest


@register_named_optimizer("muon")
def build_muon(groups: ParamGroups, cfg: OptimizerArgs, names: Names) -> torch.optim.Optimizer:
    p, lr = cfg.optimizer_params, cfg.peak_lr
    split = split_groups(groups, names, lr, _linear_role("muon", "adamw"), {"adamw": p["adam_lr"] / lr if lr else 0.0})
    return LevanterMuon(split, lr=lr, momentum=p["momentum"], nesterov=p["nesterov"],
                        backend_steps=p["backend_steps"], betas=tuple(p["betas"]), eps=p["eps"],
                        muon_epsilon=p["muon_epsilon"], max_grad_norm=p["inner_max_grad_norm"],
                        use_kimi_scaling=p["use_kimi_scaling"], orthogonalise_sections=p["orthogonalise_sections"])


@register_named_optimizer("scion")
def build_scion(groups: ParamGroups, cfg: OptimizerArgs, names: Names) -> torch.optim.Optimizer:
    p, lr = cfg.optimizer_params, cfg.peak_lr
    split = split_groups(groups, names, lr, _linear_role("scion", "signum"), {"signum": p["scion_to_signum_lr"]})
    return LevanterScion(split, lr=lr, momentum=p["momentum"], backend_steps=p["backend_steps"], beta1=p["beta1"],
                         scion_epsilon=p["scion_epsilon"], max_grad_norm=p["inner_max_grad_norm"],
                         orthogonalise_sections=p["orthogonalise_sections"])


@register_named_optimizer("mars")
def build_mars(groups: ParamGroups, cfg: OptimizerArgs, names: Names) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    # one group (each parameter's own decay): ZeRO steps a group at a time, and MARS's norm spans every gradient
    return LevanterMars(merge_groups(split_groups(groups, names, cfg.peak_lr)), lr=cfg.peak_lr,
                        betas=tuple(p["betas"]), gamma=p["gamma"], eps=p["eps"], max_grad_norm=p["inner_max_grad_norm"])


@register_named_optimizer("cautious")
def build_cautious(groups: ParamGroups, cfg: OptimizerArgs, names: Names) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterCautious(split_groups(groups, names, cfg.peak_lr), lr=cfg.peak_lr, betas=tuple(p["betas"]),
                            eps=p["eps"])


@register_optimizer("soap")
def build_soap(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterSoap(groups, lr=cfg.peak_lr, betas=tuple(p["betas"]), shampoo_beta=p["shampoo_beta"], eps=p["eps"],
                        precondition_frequency=p["precondition_frequency"], max_precond_dim=p["max_precond_dim"],
                        merge_small_dims=p["merge_small_dims"], target_merged_dim_size=p["target_merged_dim_size"],
                        one_diag=p["one_diag"], partition_grads_into_blocks=p["partition_grads_into_blocks"],
                        block_size=p["block_size"])


def build_adam_mini(groups: ParamGroups, cfg: OptimizerArgs, names: Names,
                    layouts: Mapping[torch.Tensor, HeadLayout] | None = None) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterAdamMini(mini_groups(groups, names, layouts or {}), lr=cfg.peak_lr, betas=tuple(p["betas"]),
                            eps=p["eps"], max_grad_norm=p["inner_max_grad_norm"])


NAMED_OPTIMIZERS["adam_mini"] = build_adam_mini


@register_optimizer("kron")
def build_kron(groups: ParamGroups, cfg: OptimizerArgs) -> torch.optim.Optimizer:
    p = cfg.optimizer_params
    return LevanterKron(groups, lr=cfg.peak_lr, beta1=p["beta1"], normalize_grads=p["normalize_grads"],
                        preconditioner_update_probability=p["preconditioner_update_probability"],
                        update_prob_flat_start=p["update_prob_flat_start"],
                        max_size_triangular=p["max_size_triangular"], min_ndim_triangular=p["min_ndim_triangular"],
                        memory_save_mode=p["memory_save_mode"], preconditioner_lr=p["preconditioner_lr"],
                        preconditioner_init_scale=p["preconditioner_init_scale"],
                        merge_small_dims=p["merge_small_dims"], target_merged_dim_size=p["target_merged_dim_size"],
                        partition_grads_into_blocks=p["partition_grads_into_blocks"], block_size=p["block_size"],
                        seed=p["probe_seed"])


class _DecoupledDecay:
    """Adds AdamW-style decay (``p -= lr * wd * p`` before the update) to an optimizer without weight
    decay of its own (SM3), so ``weight_decay`` is honoured rather than ignored."""

    @staticmethod
    def wrap(base: type[torch.optim.Optimizer]) -> Callable[..., torch.optim.Optimizer]:
        class WithDecoupledDecay(base):  # type: ignore[valid-type, misc]  # a base known only at run time
            @torch.no_grad()
            def step(self, closure: Callable[[], float] | None = None) -> Any:
                for group in self.param_groups:
                    decay = group.get("weight_decay_decoupled", 0.0)
                    if decay:
                        for param in group["params"]:
                            if param.grad is not None:
                                param.mul_(1.0 - group["lr"] * decay)
                return super().step(closure)

        WithDecoupledDecay.__name__ = base.__name__

        def build(groups: ParamGroups, **kwargs: Any) -> torch.optim.Optimizer:
            # the optimizer's own weight_decay (L2 on the gradient, or unknown) stays 0
            renamed = [{**{k: v for k, v in g.items() if k != "weight_decay"},
                        "weight_decay_decoupled": g.get("weight_decay", 0.0)} for g in groups]
            return WithDecoupledDecay(renamed, **kwargs)

        return build


def deepspeed_optimizer_block(cfg: OptimizerArgs) -> dict[str, Any]:
    """The DeepSpeed config ``optimizer`` block for a kind DeepSpeed builds itself."""
    params = dict(cfg.optimizer_params)
    if "betas" in params:
        params["betas"] = list(params["betas"])
    return {"type": "OneBitAdam", "params": {"lr": cfg.peak_lr, "weight_decay": cfg.applied_weight_decay, **params}}


# --- from the config ---------------------------------------------------------------------------
def build_optimizer(model: torch.nn.Module, cfg: OptimizerArgs, offload: bool = False,
                    regroup: Callable[[ParamGroups], ParamGroups] | None = None) -> torch.optim.Optimizer:
    """``offload``: ZeRO keeps the optimizer state on the CPU (``offload_optimizer``), where
    DeepSpeed requires its own CPU Adam; Adam/AdamW are switched to it (same update rule). ``regroup``: splits
    the (decay, no decay) groups further (muP's per-width learning rates, ``megatron/model/mup.py``)."""
    kind = "cpu_adam" if offload and cfg.optimizer_kind == "adam" else cfg.optimizer_kind
    builder = OPTIMIZERS.get(kind)
    named = NAMED_OPTIMIZERS.get(kind)
    if builder is None and named is None:
        raise ConfigError(f"optimizer.type={cfg.optimizer_type_shown!r} is not built by Deepy's trainer "
                          f"(kinds: {sorted({*OPTIMIZERS, *NAMED_OPTIMIZERS})})")
    groups = param_groups(model, cfg.applied_weight_decay, cfg.weight_decay_embeddings)
    if not groups:
        raise ConfigError("the model has no trainable parameters")
    groups = regroup(groups) if regroup is not None else groups
    names: Names = {param: name for name, param in model.named_parameters()}
    if kind == "adam_mini":  # its blocks follow the attention heads
        return build_adam_mini(groups, cfg, names, qkv_head_layouts(model))
    if named is not None:
        return named(groups, cfg, names)
    assert builder is not None
    return builder(groups, cfg)
