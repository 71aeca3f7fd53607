"""Levanter's ``optimizer:`` section: ``OptimizerConfig`` with its schedule keys, and ``AdamConfig``/``LionConfig``.

Defaults and meanings are read from ``src/levanter/optim/config.py`` of stanford-crfm/levanter at
9263f81e. The schedule keys become the ``levanter`` learning-rate style, which computes Levanter's curve
per step (``megatron/engine/lr_dialects.py``); the optimizer becomes Deepy's Adam (decoupled weight
decay, as ``optax.add_decayed_weights`` before the step) or Lion, and Levanter's default weight-decay
mask (no decay on embeddings, norms and biases) becomes ``weight_decay_embeddings: false``.
"""

from __future__ import annotations

from typing import Any

from megatron.neox_arguments.dialects.common import Context, Refused, Rule, noted, to

OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "type": "adam", "learning_rate": 6e-4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
    "max_grad_norm": 1.0, "min_lr_ratio": 0.1, "warmup": 0.01, "lr_schedule": "cosine",
}
"""``OptimizerConfig``/``AdamConfig`` defaults (``beta2`` 0.95, ``min_lr_ratio`` 0.1, ``weight_decay`` 0.1)."""

NOT_BUILT = {"sophia-h": "Sophia-H", "sophia-g": "Sophia-G", "muon": "Muon", "kron": "Kron (PSGD)",
             "scion": "Scion", "adopt": "ADOPT", "mars": "MARS", "cautious": "Cautious Adam", "mini": "Adam-mini",
             "rmsprop": "RMSProp", "soap": "SOAP", "skipstep": "skip-step"}
"""Levanter optimizers Deepy does not build."""

_SCHEDULES = ("constant", "cosine", "linear", "inv_sqrt", "inv")


def _kind(ctx: Context) -> str:
    kind = str(ctx.value("optimizer.type", OPTIMIZER_DEFAULTS["type"])).lower()
    if kind in NOT_BUILT:
        raise Refused(f"optimizer {kind!r} ({NOT_BUILT[kind]}) is not built here; Levanter's adam and lion are")
    if kind not in ("adam", "lion"):
        raise Refused(f"unknown Levanter optimizer {kind!r}; Deepy maps adam and lion")
    return kind


def _optimizer(value: Any, ctx: Context) -> dict[str, Any]:
    kind = _kind(ctx)
    betas = [ctx.value("optimizer.beta1", OPTIMIZER_DEFAULTS["beta1"]), ctx.value("optimizer.beta2", OPTIMIZER_DEFAULTS["beta2"])]
    if kind == "lion":  # optax.scale_by_lion(b1, b2): no epsilon
        return {"optimizer": {"type": "Lion", "params": {"betas": betas}}}
    return {"optimizer": {"type": "Adam", "params": {"betas": betas,
                                                     "eps": ctx.value("optimizer.epsilon", OPTIMIZER_DEFAULTS["epsilon"])}}}


def _max_grad_norm(value: Any, ctx: Context) -> dict[str, Any]:
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


def _adam_only(name: str) -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if _kind(ctx) != "adam" and name == "epsilon":
            raise Refused("Lion has no epsilon")
        return _optimizer(value, ctx)
    return rule


OPTIMIZER_RULES: dict[str, Rule] = {
    "optimizer.type": _optimizer,
    "optimizer.learning_rate": to("lr"),
    "optimizer.weight_decay": to("weight_decay"),
    "optimizer.beta1": _optimizer,
    "optimizer.beta2": _optimizer,
    "optimizer.epsilon": _adam_only("epsilon"),
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
    "optimizer.nesterov": _equal_or_refuse(False, "Nesterov momentum in Adam is not built here"),
    "optimizer.update_rms_clipping": _equal_or_refuse(None, "update RMS clipping is not built here"),
    "optimizer.clip_update_norm": _equal_or_refuse(None, "update-norm clipping is not built here"),
    "optimizer.skip_bad_steps": _skip_bad_steps,
    "optimizer.adamc_weight_decay": _equal_or_refuse(False, "AdamC's lr-scaled weight decay is not built here"),
}

KEEP_WHOLE = frozenset({"optimizer.lr_schedule", "optimizer.clip_update_norm", "optimizer.skip_bad_steps"})
