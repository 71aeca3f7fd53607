"""Levanter's ``optimizer:`` section: ``OptimizerConfig`` with its schedule keys, and ``AdamConfig``, ``LionConfig``,
``AdoptConfig`` and ``RMSPropMomentumConfig``, ``SophiaHConfig``, ``MiniConfig`` (Deepy's AdamMini,
``megatron/engine/levanter_adam_mini.py``), and ``MuonConfig``, ``ScionConfig``, ``MarsConfig`` and
``CautiousConfig`` (``muon.py``, ``scion.py``, ``mars.py``, ``cautious.py``: Deepy's Muon, Scion, MARS and Cautious,
``megatron/engine/levanter_whole_tensor_optim.py``, which clip inside the optimizer where Levanter does).

Defaults and meanings are read from ``src/levanter/optim/config.py``, ``adopt.py`` and ``rmsprop.py`` of
stanford-crfm/levanter at 9263f81e. The schedule keys become the ``levanter`` learning-rate style, which computes
Levanter's curve per step (``megatron/engine/lr_dialects.py``); the optimizer becomes Deepy's Adam (decoupled
weight decay, as ``optax.add_decayed_weights`` before the step), Lion, ADOPT or RMSPropMomentum (Levanter's own
updates, ``megatron/engine/levanter_optim.py``), and Levanter's default weight-decay mask (no decay on
embeddings, norms and biases) becomes ``weight_decay_embeddings: false``.
"""

from __future__ import annotations

from typing import Any

from megatron.neox_arguments.dialects.common import Context, Refused, Rule, noted, to
from megatron.neox_arguments.dialects.levanter_model import DEFAULT_TYPE

OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "type": "adam", "learning_rate": 6e-4, "weight_decay": 0.1, "max_grad_norm": 1.0, "min_lr_ratio": 0.1,
    "warmup": 0.01, "lr_schedule": "cosine",
}
"""``OptimizerConfig``'s defaults and those every built type shares (``weight_decay`` 0.1, ``max_grad_norm`` 1.0:
``AdamConfig``, ``LionConfig``, ``AdoptConfig``, ``RMSPropMomentumConfig``); the betas and epsilon are each type's
(``KIND_DEFAULTS``)."""

KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": {"beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8},  # AdamConfig, config.py:404-410
    "lion": {"beta1": 0.9, "beta2": 0.95},  # LionConfig, config.py:499-509 (its epsilon is unused)
    "adopt": {"beta1": 0.9, "beta2": 0.95, "epsilon": 1e-6},  # AdoptConfig, adopt.py:18-31
    "rmsprop": {"beta1": 0.9, "beta2": 0.99, "eps": 1e-30},  # RMSPropMomentumConfig, rmsprop.py:20-27
    # MuonConfig, muon.py:33-46 (its lr: 0.02 is never read; max_grad_norm: INNER_CLIP)
    "muon": {"beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8, "adam_lr": 6e-4, "momentum": 0.95, "nesterov": True,
             "backend_steps": 5, "muon_epsilon": 1e-8, "use_kimi_scaling": False},
    # ScionConfig, scion.py:31-38 (its lr: 0.02 is never read)
    "scion": {"scion_to_signum_lr": 0.25, "momentum": 0.95, "backend_steps": 10, "beta1": 0.9, "scion_epsilon": 1e-8},
    "mars": {"beta1": 0.95, "beta2": 0.99, "gamma": 0.025, "epsilon": 1e-8},  # MarsConfig, mars.py:25-30
    "cautious": {"beta1": 0.95, "beta2": 0.95, "epsilon": 1e-8, "gamma": 0.025},  # CautiousConfig, cautious.py:25-30
    # SophiaHConfig, sophia.py:127-137,200-203 and HessianOptConfig.update_interval, config.py:397-399
    "sophia-h": {"beta1": 0.96, "beta2": 0.99, "epsilon": 1e-12, "gamma": 0.01, "clip_threshold": 1.0,
                 "update_interval": 10, "rng_seed": 0},
    # SoapConfig, soap.py:29-49 (weight_decay 0.0: ZERO_DECAY; max_grad_norm 1.0 as Adam's)
    "soap": {"beta1": 0.95, "beta2": 0.95, "shampoo_beta": 0.95, "epsilon": 1e-8, "precondition_frequency": 10,
             "max_precond_dim": 10000, "merge_small_dims": True, "target_merged_dim_size": 2048, "one_diag": False,
             "partition_grads_into_blocks": True, "block_size": 256},
    # MiniConfig, adam_mini.py:30-36 (its lr: 0.02 and nesterov are never read; weight_decay 0.0: ZERO_DECAY;
    # max_grad_norm: INNER_CLIP)
    "mini": {"beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8},
    # KronConfig, kron.py:90-112 (weight_decay 0.1, max_grad_norm 1.0: not clipped with normalize_grads)
    "kron": {"beta1": 0.9, "normalize_grads": False, "preconditioner_update_probability": 0.05,
             "update_prob_flat_start": 500, "max_size_triangular": 25000, "min_ndim_triangular": 2,
             "memory_save_mode": None, "preconditioner_lr": 0.1, "preconditioner_init_scale": 1.0,
             "merge_small_dims": True, "target_merged_dim_size": 8192, "partition_grads_into_blocks": True,
             "block_size": 256},
}
"""Each built type's own fields and defaults (RMSProp spells its epsilon ``eps``)."""

NOT_BUILT = {"sophia-g": "Sophia-G (Levanter's own raises NotImplementedError, sophia.py:406)",
             "skipstep": "skip-step"}
"""Levanter optimizers Deepy does not build."""

_SCHEDULES = ("constant", "cosine", "linear", "inv_sqrt", "inv")


def _kind(ctx: Context) -> str:
    kind = str(ctx.value("optimizer.type", OPTIMIZER_DEFAULTS["type"])).lower()
    if kind in NOT_BUILT:
        raise Refused(f"optimizer {kind!r} ({NOT_BUILT[kind]}) is not built here; Levanter's "
                      f"{', '.join(KIND_DEFAULTS)} are")
    if kind not in KIND_DEFAULTS:
        raise Refused(f"unknown Levanter optimizer {kind!r}; Deepy maps {', '.join(KIND_DEFAULTS)}")
    return kind


_DEEPY_TYPE = {"adam": "Adam", "lion": "Lion", "adopt": "ADOPT", "rmsprop": "RMSPropMomentum", "sophia-h": "SophiaH",
               "muon": "Muon", "scion": "Scion", "mars": "MARS", "cautious": "Cautious", "soap": "SOAP",
               "mini": "AdamMini", "kron": "Kron"}
_WHOLE_TENSOR_PARAMS = {"muon": ("adam_lr", "momentum", "nesterov", "backend_steps", "muon_epsilon", "use_kimi_scaling"),
                        "scion": ("scion_to_signum_lr", "momentum", "backend_steps", "beta1", "scion_epsilon"),
                        "mars": ("gamma",)}
"""Muon's, Scion's and MARS's fields handed to Deepy's block under their Levanter names, besides betas and epsilon
(``megatron/engine/optimizer_block.py``); Cautious's ``gamma`` is never read by its ``build`` (cautious.py:39-66)."""
INNER_CLIP = frozenset({"muon", "scion", "mars", "mini"})
"""Types whose ``max_grad_norm`` Levanter applies inside the optimizer (muon.py:69-73, scion.py:58-61: the AdamW or
signum half only; mars.py:106-109: the corrected gradient), Deepy's ``inner_max_grad_norm``: ``gradient_clipping`` 0."""
ZERO_DECAY = frozenset({"muon", "scion", "soap", "mini"})
"""Types whose ``weight_decay`` defaults to 0.0 (muon.py:38, scion.py:35, adam_mini.py:31), not ``OptimizerConfig``'s
0.1."""
_EXTRA_PARAMS = {"sophia-h": ("gamma", "clip_threshold", "update_interval", "rng_seed"),
                 "soap": ("shampoo_beta", "precondition_frequency", "max_precond_dim", "merge_small_dims",
                          "target_merged_dim_size", "one_diag", "partition_grads_into_blocks", "block_size")}
"""Fields handed to Deepy's optimizer block under their Levanter names, besides the betas and epsilon."""


def _optimizer(value: Any, ctx: Context) -> dict[str, Any]:
    kind = _kind(ctx)
    fields = KIND_DEFAULTS[kind]
    for name in ("epsilon", "eps"):
        if name not in fields and ctx.value(f"optimizer.{name}") is not None and kind != "lion":
            raise Refused(f"Levanter's {kind} optimizer has no {name}; it has {', '.join(fields)}")
    got = {name: ctx.value(f"optimizer.{name}", default) for name, default in fields.items()}
    params: dict[str, Any] = {"betas": [got["beta1"], got["beta2"]]} if "beta2" in got else {}
    if kind not in ("lion", "scion", "kron"):  # optax.scale_by_lion(b1, b2): no epsilon; Scion: scion_epsilon
        params["eps"] = got.get("epsilon", got.get("eps"))
    for name in _WHOLE_TENSOR_PARAMS.get(kind, ()):
        params[name] = got[name]
    if kind in INNER_CLIP:
        params["inner_max_grad_norm"] = ctx.value("optimizer.max_grad_norm", OPTIMIZER_DEFAULTS["max_grad_norm"])
    for name in _EXTRA_PARAMS.get(kind, ()):
        params[name] = got[name]
    if kind == "kron":  # every KronConfig field under its own name (megatron/engine/optimizer_block.KronParams)
        params.update(got)
    if kind == "mini" and str(ctx.value("model.type", DEFAULT_TYPE)).lower() == "gpt2":
        raise Refused("Levanter's mini on its gpt2 model averages the fused c_attn over the head axis of its "
                      "(layers, embed, qkv, heads, head_size) array (adam_mini.py:65-105@9263f81e), which Deepy's "
                      "Adam-mini does not build; its blocks follow the Llama family's q_proj/k_proj/v_proj/o_proj")
    if kind in ("muon", "scion"):  # Levanter's Llama family keeps q/k/v and gate/up apart, its GPT-2 c_attn fused
        params["orthogonalise_sections"] = str(ctx.value("model.type", DEFAULT_TYPE)).lower() != "gpt2"
    return {"optimizer": {"type": _DEEPY_TYPE[kind], "params": params}}


def _schedule_list(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) not in ("adopt", "soap"):
        raise Refused("only Levanter's adopt and soap optimizers have schedule_list")
    return noted("AdoptConfig and SoapConfig declare it but their build() never reads it "
                 "(adopt.py:31, soap.py:40@9263f81e)")


def _max_grad_norm(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) == "sophia-h":  # BaseSophiaConfig has no max_grad_norm and its chain clips nothing (sophia.py:150-178)
        leaf = ctx.leaves.get("optimizer.max_grad_norm")
        if leaf is not None and leaf.where != "Levanter's default":
            raise Refused("Levanter's sophia-h optimizer has no max_grad_norm (its update is clipped element-wise "
                          "by clip_threshold)")
        return {"gradient_clipping": 0.0}
    if _kind(ctx) == "kron" and ctx.value("optimizer.normalize_grads", False):  # kron.py:121: no clip
        return {"gradient_clipping": 0.0}
    if _kind(ctx) in INNER_CLIP:  # the optimizer clips (inner_max_grad_norm, set by _optimizer)
        return {"gradient_clipping": 0.0}
    return {"gradient_clipping": float(value) if value else 0.0}  # None/0: optax clips nothing


def _schedule(value: Any, ctx: Context) -> dict[str, Any]:
    """A name, or Levanter's ``LrSchedule`` choice: ``{type: cosine, exponent}``, ``{type: inv_sqrt, timescale}``."""
    spec = dict(value) if isinstance(value, dict) else {"type": value}
    kind = str(spec.pop("type", "cosine"))
    if kind == "power":
        raise Refused("the power schedule (for muP runs) is not built here")
    if kind not in _SCHEDULES:
        raise Refused(f"lr_schedule {kind!r} is not one of Levanter's: {', '.join(_SCHEDULES)}, power")
    fields = {"cosine": {"exponent": "levanter_cosine_exponent"},
              "inv_sqrt": {"timescale": "levanter_inv_sqrt_timescale"}}.get(kind, {})
    extra = set(spec) - set(fields)
    if extra:
        raise Refused(f"{sorted(extra)} are not fields of Levanter's {kind} schedule")
    return {"lr_decay_style": "levanter", "levanter_lr_schedule": kind,
            **{fields[key]: float(v) for key, v in spec.items()}}


def _schedule_key(name: str) -> Rule:
    return lambda value, ctx: {"lr_decay_style": "levanter", name: value}


def _optional_schedule_key(name: str) -> Rule:
    return lambda value, ctx: {"lr_decay_style": "levanter", **({name: value} if value is not None else {})}


def _haps(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return noted("deprecated; unset")
    return {"lr_decay_style": "levanter", "levanter_cycles": list(value)}  # _get_cycle_minima: haps = cycles


def _weight_decay_mask(value: Any, ctx: Context) -> dict[str, Any]:
    """``build_weight_decay_mask``: with neither key set, the default mask (no decay for norms,
    embeddings and biases); ``default_weight_decay_mask: false`` with no modules decays everything."""
    modules = ctx.value("optimizer.weight_decay_modules")
    default = ctx.value("optimizer.default_weight_decay_mask")
    if modules is not None:
        raise Refused("a custom weight-decay mask is not built here; Deepy decays weight matrices but not norms "
                      "or biases, and not embeddings under Levanter's default mask")
    if default is False:
        raise Refused("default_weight_decay_mask: false decays norms and biases too, which Deepy never does")
    return {"weight_decay_embeddings": False}


def _equal_or_refuse(default: Any, reason: str) -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if value != default:
            raise Refused(reason)
        return noted(f"{value!r} is Levanter's default, what Deepy does")
    return rule


def _skip_bad_steps(value: Any, ctx: Context) -> dict[str, Any]:
    """``SkipStepConfig.from_bool_int_or_config``: true = the default window (128, sigma 6.0), an integer = the
    window, or ``{rolling_interval_length, sigma_factor}``; false/0 = off. Only ``AdamConfig`` has the key."""
    if value is False or value is None or value == 0:
        return {}
    if _kind(ctx) != "adam":
        raise Refused("only Levanter's adam optimizer has skip_bad_steps")
    if value is True:
        spec: dict[str, Any] = {}
    elif isinstance(value, int):
        spec = {"rolling_interval_length": value}
    elif isinstance(value, dict):
        spec = dict(value)
    else:
        raise Refused(f"{value!r} is not a bool, an integer or a SkipStepConfig")
    window = spec.pop("rolling_interval_length", 128)
    sigma = spec.pop("sigma_factor", 6.0)
    if spec:
        raise Refused(f"SkipStepConfig has no {', '.join(map(str, spec))}; it has rolling_interval_length and "
                      "sigma_factor")
    return {"skip_bad_steps_window": int(window), "skip_bad_steps_sigma": float(sigma)}


def _epsilon(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) == "lion":
        raise Refused("Lion has no epsilon")
    return _optimizer(value, ctx)


def _soap_field(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) != "soap":
        raise Refused(f"only Levanter's soap optimizer has {', '.join(_EXTRA_PARAMS['soap'])}")
    return _optimizer(value, ctx)


def _kron_field(name: str) -> Rule:
    """A KronConfig field (kron.py:90-112@9263f81e); the four it shares with SoapConfig are either's."""
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        kind = _kind(ctx)
        if kind not in ("kron", "soap") or name not in KIND_DEFAULTS[kind]:
            owners = [k for k in ("soap", "kron") if name in KIND_DEFAULTS[k]]
            raise Refused(f"only Levanter's {' and '.join(owners)} optimizer{'s' * (len(owners) > 1)} "
                          f"{'have' if len(owners) > 1 else 'has'} {name}")
        return _optimizer(value, ctx)
    return rule


def _sophia_field(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) != "sophia-h":
        raise Refused("only Levanter's sophia-h optimizer has gamma, clip_threshold, update_interval and rng_seed")
    return _optimizer(value, ctx)


def _whole_tensor_field(name: str) -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        kind = _kind(ctx)
        if name not in KIND_DEFAULTS[kind]:
            raise Refused(f"Levanter's {kind} optimizer has no {name}")
        if kind == "cautious":  # gamma
            return noted("CautiousConfig declares gamma but its build() never reads it (cautious.py:27,39-66@9263f81e)")
        return _optimizer(value, ctx)
    return rule


def _gamma(value: Any, ctx: Context) -> dict[str, Any]:
    return _whole_tensor_field("gamma")(value, ctx) if _kind(ctx) in ("mars", "cautious") else _sophia_field(value, ctx)


def _unread_lr(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) not in ("muon", "scion", "mini"):
        raise Refused("only Levanter's muon, scion and mini optimizers have lr (the rate is learning_rate)")
    return noted(f"{_kind(ctx)}'s lr field is never read by its build(), which schedules learning_rate "
                 "(muon.py:52, scion.py:44, adam_mini.py:30,38-79@9263f81e)")


def _weight_decay(value: Any, ctx: Context) -> dict[str, Any]:
    leaf = ctx.leaves.get("optimizer.weight_decay")
    if _kind(ctx) in ZERO_DECAY and (leaf is None or leaf.where == "Levanter's default"):
        return {"weight_decay": 0.0}
    return {"weight_decay": value}


def _nesterov(value: Any, ctx: Context) -> dict[str, Any]:
    if _kind(ctx) == "muon":
        return _optimizer(value, ctx)
    if _kind(ctx) == "mini":
        return noted("MiniConfig declares nesterov but its build() never reads it (adam_mini.py:36,38-79@9263f81e)")
    return _equal_or_refuse(False, "Nesterov momentum in Adam is not built here")(value, ctx)


OPTIMIZER_RULES: dict[str, Rule] = {
    "optimizer.type": _optimizer,
    "optimizer.learning_rate": to("lr"),
    "optimizer.weight_decay": _weight_decay,
    "optimizer.beta1": _optimizer,
    "optimizer.beta2": _optimizer,
    "optimizer.epsilon": _epsilon,
    "optimizer.eps": _epsilon,
    "optimizer.gamma": _gamma,
    "optimizer.clip_threshold": _sophia_field,
    "optimizer.update_interval": _sophia_field,
    "optimizer.rng_seed": _sophia_field,
    **{f"optimizer.{name}": _soap_field for name in _EXTRA_PARAMS["soap"]},
    **{f"optimizer.{name}": _kron_field(name) for name in KIND_DEFAULTS["kron"] if name != "beta1"},
    "optimizer.mu_dtype": _equal_or_refuse(None, "SOAP's state is kept in the parameter's dtype (mu_dtype: null)"),
    "optimizer.precond_dtype": _equal_or_refuse(None, "SOAP's preconditioners are kept in the parameter's dtype "
                                                      "(precond_dtype: null)"),
    "optimizer.schedule_list": _schedule_list,
    "optimizer.max_grad_norm": _max_grad_norm,
    "optimizer.min_lr_ratio": _schedule_key("levanter_min_lr_ratio"),
    "optimizer.warmup": _schedule_key("levanter_warmup"),
    "optimizer.decay": _optional_schedule_key("levanter_decay"),
    "optimizer.rewarmup": _schedule_key("levanter_rewarmup"),
    "optimizer.cooldown": _optional_schedule_key("levanter_cooldown"),
    "optimizer.cycles": _optional_schedule_key("levanter_cycles"),
    "optimizer.cycle_length": _optional_schedule_key("levanter_cycle_length"),
    "optimizer.haps": _haps,
    "optimizer.lr_schedule": _schedule,
    "optimizer.weight_decay_modules": _weight_decay_mask,
    "optimizer.default_weight_decay_mask": _weight_decay_mask,
    "optimizer.nesterov": _nesterov,
    "optimizer.lr": _unread_lr,
    **{f"optimizer.{name}": _whole_tensor_field(name) for name in (
        "adam_lr", "momentum", "backend_steps", "muon_epsilon", "use_kimi_scaling", "scion_to_signum_lr",
        "scion_epsilon")},
    "optimizer.update_rms_clipping": _equal_or_refuse(None, "update RMS clipping is not built here"),
    "optimizer.clip_update_norm": _equal_or_refuse(None, "update-norm clipping is not built here"),
    "optimizer.skip_bad_steps": _skip_bad_steps,
    "optimizer.adamc_weight_decay": _equal_or_refuse(False, "AdamC's lr-scaled weight decay is not built here"),
}

KEEP_WHOLE = frozenset({"optimizer.lr_schedule", "optimizer.clip_update_norm", "optimizer.skip_bad_steps"})
