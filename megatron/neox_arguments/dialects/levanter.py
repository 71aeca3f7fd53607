"""Levanter's dialect: nested ``data/model/trainer/optimizer`` configs and draccus ``--a.b value`` flags.

Meanings follow Levanter's Configuration Guide (``docs/Configuration-Guide.md``) and its trainer,
checkpointer, W&B, optimizer and model config classes. Each key maps to the GPT-NeoX key(s) that do
the same thing here, is refused with the reason it has no meaning (JAX meshes, TPU/Ray plumbing), or
is unknown (a did-you-mean). ``docs/dialects.md`` lists every key; ``tests/unit/test_dialects.py``
checks that list against the tables below.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from megatron.model.mlp_width import intermediate_size_for
from megatron.neox_arguments.dialects.common import Context, Leaf, Refused, Rule, Translation, to

NAME = "levanter"
SECTIONS = ("data", "model", "trainer", "optimizer")
"""Top-level keys of Levanter's TrainLmConfig; a config holding any of them (as mappings) is Levanter's."""

# ---------------------------------------------------------------------------------------- model

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Levanter's Gpt2Config defaults: GPT-2 small, learned positions, tied embeddings, gelu_new
    "gpt2": dict(pos_emb="learned", norm="layernorm", activation="gelu_tanh", no_weight_tying=False,
                 hidden_size=768, num_attention_heads=12, num_layers=12, seq_length=1024,
                 max_position_embeddings=1024, layernorm_epsilon=1e-5, init_method_std=0.02),
    # LlamaConfig defaults: Llama-2 7B, rotary, RMSNorm, SwiGLU, no biases, untied output
    "llama": dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu", no_weight_tying=True,
                  use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False,
                  hidden_size=4096, intermediate_size=3 * 11008, num_attention_heads=32, num_kv_heads=32,
                  num_layers=32, seq_length=2048, max_position_embeddings=2048, rms_norm_epsilon=1e-5,
                  rotary_emb_base=10000, init_method_std=0.02),
    # MistralConfig defaults: Mistral 7B (grouped-query attention, 4096-token sliding window)
    "mistral": dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu", no_weight_tying=True,
                    use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False,
                    hidden_size=4096, intermediate_size=3 * 14336, num_attention_heads=32, num_kv_heads=8,
                    num_layers=32, seq_length=8192, max_position_embeddings=8192, rms_norm_epsilon=1e-5,
                    rotary_emb_base=10000, sliding_window_width=4096, init_method_std=0.02),
}

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                "silu": "silu", "swish": "silu"}
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu"}


def model_type(ctx: Context) -> str:
    kind = str(ctx.value("model.type", "gpt2")).lower()
    if kind not in MODEL_PRESETS:
        raise Refused(f"model type {kind!r} is not built here; Deepy runs {', '.join(MODEL_PRESETS)}")
    return kind


def _model_type_rule(value: Any, ctx: Context) -> dict[str, Any]:
    model_type(ctx)  # checks the name; the preset itself is implied (explicit fields win)
    return {}


def _seq_len(value: Any, ctx: Context) -> dict[str, Any]:
    return {"seq_length": value, "max_position_embeddings": value}


def _activation(value: Any, ctx: Context) -> dict[str, Any]:
    name = _ACTIVATIONS.get(str(value))
    if name is None:
        raise Refused(f"activation_function {value!r} is not built here; use one of {', '.join(_ACTIVATIONS)}")
    if model_type(ctx) != "gpt2":  # Llama's MLP gates the activation
        gated = _GATED.get(str(value))
        if gated is None:
            raise Refused(f"a gated ({model_type(ctx)}) MLP gates silu, gelu or relu, not {value!r}")
        return {"activation": gated}
    return {"activation": name}


def _intermediate_dim(value: Any, ctx: Context) -> dict[str, Any]:
    """Levanter's width of each half of a gated MLP is GPT-NeoX's intermediate_size / 3
    (``megatron/model/mlp_width.py``); GPT-2's MLP is not gated."""
    size = intermediate_size_for(int(value), gated=model_type(ctx) != "gpt2")
    if size is None:
        raise Refused(f"intermediate_dim {value}: GPT-NeoX's MLP rule builds no odd ungated width; use an even one")
    return {"intermediate_size": size}


def _layer_norm_epsilon(value: Any, ctx: Context) -> dict[str, Any]:
    return {"layernorm_epsilon" if model_type(ctx) == "gpt2" else "rms_norm_epsilon": value}


def _use_bias(value: Any, ctx: Context) -> dict[str, Any]:
    return {"use_bias_in_attn_linear": bool(value), "use_bias_in_mlp": bool(value)}


def _tie(value: Any, ctx: Context) -> dict[str, Any]:
    return {"no_weight_tying": not value}


def _rope(value: Any, ctx: Context) -> dict[str, Any]:
    if not isinstance(value, dict) or str(value.get("type", "default")) != "default":
        raise Refused("only the default rotary embedding is built here: rope: {type: default, theta: ...}")
    extra = set(value) - {"type", "theta"}
    if extra:
        raise Refused(f"rope keys {sorted(extra)} are not built here; only theta")
    return {"rotary_emb_base": value["theta"]} if "theta" in value else {}


def _dropout_equal_to_resid(value: Any, ctx: Context) -> dict[str, Any]:
    if value != ctx.value("model.resid_pdrop", 0.0):
        raise Refused("Deepy drops out the embeddings with hidden_dropout, so embed_pdrop must equal resid_pdrop")
    return {}


def _no_upcast(value: Any, ctx: Context) -> dict[str, Any]:
    if value:
        return {}  # the attention softmax is computed in fp32 by SDPA anyway (see honesty.NO_EFFECT_KEYS)
    raise Refused("Deepy's attention always accumulates its softmax in fp32")


MODEL_RULES: dict[str, Rule] = {
    "model.type": _model_type_rule,
    "model.hidden_dim": to("hidden_size"),
    "model.intermediate_dim": _intermediate_dim,
    "model.num_heads": to("num_attention_heads"),
    "model.num_kv_heads": to("num_kv_heads"),
    "model.num_layers": to("num_layers"),
    "model.seq_len": _seq_len,
    "model.gradient_checkpointing": to("checkpoint_activations"),
    "model.scale_attn_by_inverse_layer_idx": to("scale_attn_by_inverse_layer_idx"),
    "model.initializer_range": to("init_method_std"),
    "model.resid_pdrop": to("hidden_dropout"),
    "model.attn_pdrop": to("attention_dropout"),
    "model.embed_pdrop": _dropout_equal_to_resid,
    "model.layer_norm_epsilon": _layer_norm_epsilon,
    "model.activation_function": _activation,
    "model.use_bias": _use_bias,
    "model.use_layer_norm_weight": lambda v, ctx: {} if v else {"norm": "non_parametric_layernorm"},
    "model.tie_word_embeddings": _tie,
    "model.rope": _rope,
    "model.rope.type": lambda v, ctx: _rope({"type": v}, ctx),
    "model.rope.theta": to("rotary_emb_base"),
    "model.sliding_window": to("sliding_window_width"),
    "model.upcast_attn": _no_upcast,
}

# -------------------------------------------------------------------------------------- trainer

_DTYPES = {"f32": "fp32", "float32": "fp32", "full": "fp32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "f16": "fp16", "float16": "fp16", "half": "fp16"}
_PARAM_KEYS = {"p": "p", "params": "p", "c": "c", "compute": "c", "o": "o", "output": "o"}


def _mixed_precision(value: Any, ctx: Context) -> dict[str, Any]:
    """jmp's policy string: ``p=f32,c=bfloat16`` or one dtype for everything."""
    text = str(value).replace(" ", "")
    policy: dict[str, str] = {}
    if "=" not in text:
        policy = {"p": text, "c": text}
    else:
        for part in text.split(","):
            key, _, dtype = part.partition("=")
            if key not in _PARAM_KEYS:
                raise Refused(f"unknown mixed-precision part {key!r}; write p=...,c=...")
            policy[_PARAM_KEYS[key]] = dtype
    for part, dtype in policy.items():
        if dtype not in _DTYPES:
            raise Refused(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    if _DTYPES[policy.get("p", "f32")] != "fp32":
        raise Refused("Deepy keeps the master parameters in fp32 (p=f32); only the compute dtype (c=) changes")
    if "o" in policy and _DTYPES[policy["o"]] != _DTYPES[policy.get("c", "f32")]:
        raise Refused("the output dtype (o=) follows the compute dtype here; leave o= out")
    return {"precision": _DTYPES[policy.get("c", "f32")]}


def _micro_batch(value: Any, ctx: Context) -> dict[str, Any]:
    if value in (-1, None):
        return {}  # Levanter's -1: the whole batch per step, derived from train_batch_size
    return {"train_micro_batch_size_per_gpu": value}


def _eval_micro_batch(value: Any, ctx: Context) -> dict[str, Any]:
    train = ctx.value("trainer.per_device_parallelism", ctx.value("trainer.per_device_train_parallelism", -1))
    if value in (-1, None, train):
        return {}  # Levanter's default: the training micro batch, which is what Deepy evaluates with
    raise Refused(f"Deepy evaluates with the training micro batch ({train}); leave it out or set it equal")


def _eval_batches(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        raise Refused("Deepy evaluates a fixed number of batches each time; give a number")
    return {"eval_iters": value}


def run_id(ctx: Context) -> str:
    """Levanter's run id: ``trainer.id``, else the W&B id, else a fresh one (Levanter makes one per launch)."""
    for key in ("trainer.id", "trainer.wandb.id", "trainer.tracker.id"):
        if ctx.value(key):
            return str(ctx.value(key))
    return _fresh_id()


_FRESH: list[str] = []


def _fresh_id() -> str:
    if not _FRESH:  # one id per process, so every rule of one translation sees the same
        _FRESH.append(secrets.token_hex(4))
    return _FRESH[0]


def _checkpoint_paths(ctx: Context) -> dict[str, Any]:
    """``checkpointer.base_path``/<run id> (Levanter appends the run id unless told not to); the same
    directory is where a restart loads from unless ``load_checkpoint_path`` says otherwise."""
    base = ctx.value("trainer.checkpointer.base_path")
    if base is None:
        return {}
    path = os.path.join(str(base), run_id(ctx)) if ctx.value("trainer.checkpointer.append_run_id_to_base_path", True) else str(base)
    values: dict[str, Any] = {"save": path}
    if ctx.value("trainer.load_checkpoint_path") is None:
        values["load"] = path
    return values


def _id(value: Any, ctx: Context) -> dict[str, Any]:
    values = _checkpoint_paths(ctx)
    block = tracker_block(ctx)
    if block is not None:
        values["tracker"] = block
    return values


_WANDB_FIELDS = {"project": "project", "entity": "entity", "name": "name", "group": "group", "tags": "tags",
                 "notes": "notes", "mode": "mode", "id": "id"}


def _tracker_from(spec: dict[str, Any], ctx: Context) -> dict[str, Any] | None:
    kind = str(spec.get("type", "wandb"))
    if kind == "noop":
        return None
    if kind == "tensorboard":
        return {"type": "tensorboard", **({"logdir": spec["logdir"]} if "logdir" in spec else {})}
    if kind != "wandb":
        raise Refused(f"tracker type {kind!r} is not built here; use wandb, tensorboard or noop")
    block: dict[str, Any] = {"type": "wandb"}
    for key, value in spec.items():
        if key in ("type", "resume"):
            continue
        if key not in _WANDB_FIELDS:
            raise Refused(f"W&B field {key!r} is not read here; Deepy reads {', '.join(_WANDB_FIELDS)}, resume")
        if value is not None:
            block[_WANDB_FIELDS[key]] = list(value) if key == "tags" else value
    block.setdefault("id", run_id(ctx))
    return block


def tracker_block(ctx: Context) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The tracker(s) of ``trainer.wandb.*`` / ``trainer.tracker`` as Deepy's ``tracker`` key."""
    for prefix in ("trainer.tracker", "trainer.wandb"):
        whole = ctx.value(prefix)
        if isinstance(whole, list):
            blocks = [b for b in (_tracker_from(dict(item), ctx) for item in whole) if b is not None]
            return blocks or None
        spec = {path[len(prefix) + 1:]: leaf.value for path, leaf in ctx.leaves.items() if path.startswith(prefix + ".")}
        if spec or whole is not None:
            if prefix == "trainer.wandb":
                spec.setdefault("type", "wandb")
            return _tracker_from(spec, ctx)
    return None


def _tracker(value: Any, ctx: Context) -> dict[str, Any]:
    block = tracker_block(ctx)
    return {"tracker": block} if block is not None else {}


def _resume(value: Any, ctx: Context) -> dict[str, Any]:
    if value in (True, "allow", "auto", "must", None):
        return _tracker(value, ctx)  # what Deepy does: a resumed checkpoint continues its W&B run
    raise Refused("Deepy always continues the W&B run of the checkpoint it resumes; leave resume out or true")


def _load_checkpoint(value: Any, ctx: Context) -> dict[str, Any]:
    return {} if value is None else {"load_checkpoint": bool(value)}


def _profile_stop(value: Any, ctx: Context) -> dict[str, Any]:
    start = ctx.value("trainer.profiler_start_step", 5)
    return {"profile_step_start": start, "profile_step_stop": start + int(value)}


_TRACKER_PATHS = [*(f"trainer.{p}.{f}" for p in ("wandb", "tracker") for f in _WANDB_FIELDS),
                  "trainer.tracker.type", "trainer.tracker.logdir"]

TRAINER_RULES: dict[str, Rule] = {
    "trainer.seed": to("seed"),
    "trainer.num_train_steps": to("train_iters"),
    "trainer.train_batch_size": to("train_batch_size"),
    "trainer.per_device_parallelism": _micro_batch,
    "trainer.per_device_train_parallelism": _micro_batch,
    "trainer.per_device_eval_parallelism": _eval_micro_batch,
    "trainer.steps_per_eval": to("eval_interval"),
    "trainer.max_eval_batches": _eval_batches,
    "trainer.mp": _mixed_precision,
    "trainer.model_axis_size": to("model_parallel_size"),
    "trainer.id": _id,
    "trainer.log_dir": to("log_dir"),
    "trainer.load_checkpoint": _load_checkpoint,
    "trainer.load_checkpoint_path": to("load"),
    "trainer.initialize_from": to("initialize_from"),
    "trainer.checkpointer.base_path": lambda v, ctx: _checkpoint_paths(ctx),
    "trainer.checkpointer.append_run_id_to_base_path": lambda v, ctx: _checkpoint_paths(ctx),
    "trainer.checkpointer.save_interval": to("save_interval"),
    "trainer.checkpointer.keep": to("keep"),
    "trainer.profiler": to("profile"),
    "trainer.profiler_start_step": lambda v, ctx: {"profile_step_start": v},
    "trainer.profiler_num_steps": _profile_stop,
    "trainer.tracker": _tracker,
    "trainer.wandb": _tracker,
    "trainer.wandb.resume": _resume,
    "trainer.tracker.resume": _resume,
    **{path: _tracker for path in _TRACKER_PATHS},
}

_MESH = "a JAX mesh/axis mapping; Deepy shards with sizes instead (model_axis_size -> model_parallel_size, ZeRO via sharding_strategy)"
TRAINER_REFUSED: dict[str, str] = {
    "trainer.axis_resources": _MESH,
    "trainer.parameter_axis_resources": _MESH,
    "trainer.compute_axis_resources": _MESH,
    "trainer.axis_mapping": _MESH,
    "trainer.batch_axis": _MESH,
    "trainer.fsdp_axis": _MESH,
    "trainer.tensor_parallel_axes": _MESH,
    "trainer.mesh": _MESH,
    "trainer.replica_ici_axis_size": "a TPU slice (ICI) replica count; Deepy's data parallelism is the world size over the model-parallel size",
    "trainer.replica_dcn_axis_size": "a TPU multi-slice (DCN) replica count; see replica_ici_axis_size",
    "trainer.ray": "Ray cluster settings; Deepy launches its ranks itself (num_gpus, num_nodes, hostfile, launcher)",
    "trainer.distributed": "JAX's cluster discovery; Deepy's launcher sets up torch.distributed (num_nodes, hostfile, master_port)",
    "trainer.jax_config": "JAX runtime flags; Deepy runs on PyTorch",
    "trainer.jax_compilation_cache_dir": "JAX's compile cache; Deepy runs on PyTorch",
    "trainer.require_accelerator": "Deepy runs on CPU (gloo) and GPUs (nccl) alike",
    "trainer.shutdown_at_exit": "a TPU VM shutdown hook",
    "trainer.fp8": "fp8 training is not built here",
    "trainer.wandb.save_xla_dumps": "XLA compiler dumps; Deepy runs on PyTorch",
    "trainer.tracker.save_xla_dumps": "XLA compiler dumps; Deepy runs on PyTorch",
    "trainer.wandb.save_code": "Deepy records the code's git commit (git_hash) instead of uploading code",
    "trainer.tracker.save_code": "Deepy records the code's git commit (git_hash) instead of uploading code",
}

# ------------------------------------------------------------------------------------ optimizer


def _optimizer_block(ctx: Context) -> dict[str, Any]:
    kind = str(ctx.value("optimizer.type", "adam")).lower()
    if kind not in ("adam", "adamw"):
        raise Refused(f"optimizer type {kind!r} is not mapped; Levanter's adam is Deepy's Adam (decoupled decay)")
    return {"type": "Adam", "params": {"betas": [ctx.value("optimizer.beta1", 0.9), ctx.value("optimizer.beta2", 0.999)],
                                       "eps": ctx.value("optimizer.epsilon", 1e-8)}}


def _optimizer(value: Any, ctx: Context) -> dict[str, Any]:
    return {"optimizer": _optimizer_block(ctx)}


def _decay(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, float) and value <= 1:
        return {"decay_fraction": value}
    steps = ctx.value("trainer.num_train_steps", LEVANTER_DEFAULTS["trainer.num_train_steps"])
    return {"decay_fraction": int(value) / int(steps)}


_SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear", "inv_sqrt": "inv_sqrt", "inv": "inv"}


def _schedule(value: Any, ctx: Context) -> dict[str, Any]:
    if str(value) not in _SCHEDULES:
        raise Refused(f"lr_schedule {value!r} is not built here; use one of {', '.join(_SCHEDULES)}")
    return {"lr_decay_style": _SCHEDULES[str(value)]}


OPTIMIZER_RULES: dict[str, Rule] = {
    "optimizer.type": _optimizer,
    "optimizer.learning_rate": to("lr"),
    "optimizer.weight_decay": to("weight_decay"),
    "optimizer.beta1": _optimizer,
    "optimizer.beta2": _optimizer,
    "optimizer.epsilon": _optimizer,
    "optimizer.max_grad_norm": to("gradient_clipping"),
    "optimizer.min_lr_ratio": to("min_lr_ratio"),
    "optimizer.warmup": to("warmup"),
    "optimizer.warmup_ratio": to("warmup"),
    "optimizer.decay": _decay,
    "optimizer.lr_schedule": _schedule,
    "optimizer.cycles": to("cycles"),
    "optimizer.rewarmup": to("rewarmup"),
}

# ----------------------------------------------------------------------------------------- data


def _tokenizer(value: Any, ctx: Context) -> dict[str, Any]:
    path = str(value)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise Refused("a Hugging Face hub name would be downloaded; give a local tokenizer.json (or its directory)")
    return {"tokenizer_type": "HFTokenizer", "vocab_file": path}


DATA_RULES: dict[str, Rule] = {
    "data.train_urls": to("train_urls"),
    "data.validation_urls": to("validation_urls"),
    "data.cache_dir": to("cache_dir"),
    "data.tokenizer": _tokenizer,
}

_DOWNLOAD = "a Hugging Face dataset, which would be downloaded; give local train_urls/validation_urls"
DATA_REFUSED: dict[str, str] = {
    "data.id": _DOWNLOAD,
    "data.name": _DOWNLOAD,
    "data.stream": _DOWNLOAD,
    "data.configs": "data mixtures of named sources are not mapped; blend prepared datasets with train_data_paths/train_data_weights",
    "data.train_weights": "data mixtures of named sources are not mapped; blend prepared datasets with train_data_paths/train_data_weights",
    "data.enforce_eos": "documents end with the tokenizer's end-of-text token whenever Deepy tokenizes train_urls",
    "data.shuffle": "Deepy's sample index always shuffles, from the seed",
}

# ----------------------------------------------------------------------------------- everything

RULES: dict[str, Rule] = {**MODEL_RULES, **TRAINER_RULES, **OPTIMIZER_RULES, **DATA_RULES}
REFUSED: dict[str, str] = {**TRAINER_REFUSED, **DATA_REFUSED}

LEVANTER_DEFAULTS: dict[str, Any] = {
    "trainer.seed": 0,
    "trainer.num_train_steps": 400_000,
    "trainer.train_batch_size": 32,
    "optimizer.learning_rate": 1e-4,
    "optimizer.weight_decay": 0.0,
    "optimizer.lr_schedule": "cosine",
    "optimizer.type": "adam",
}
"""Levanter's defaults (its Configuration Guide) where GPT-NeoX's differ: a key a Levanter user leaves
out means what it means in Levanter."""


def implied(translation: Translation, leaves: dict[str, Leaf], source: str) -> None:
    """The model type's preset and Levanter's defaults, for every GPT-NeoX key nothing explicit set."""
    ctx = Context(leaves)
    kind = model_type(ctx)
    where = leaves["model.type"].where if "model.type" in leaves else source
    preset = dict(MODEL_PRESETS[kind])
    if kind == "llama" and "model.num_heads" in leaves:
        preset["num_kv_heads"] = leaves["model.num_heads"].value  # no grouping unless num_kv_heads says so
    translation.put(Leaf(f"model.type={kind}", kind, where), preset, implied=True)
    # Levanter builds the LR schedule from the config at every launch, also when it resumes
    translation.put(Leaf("schedule from the config", None, "Levanter"), {"override_lr_scheduler": True}, implied=True)
    # Levanter's trainer reports its metrics every step
    translation.put(Leaf("metrics every step", None, "Levanter"), {"log_interval": 1}, implied=True)
    for path, value in LEVANTER_DEFAULTS.items():
        if path not in leaves:
            rule = RULES[path]
            translation.put(Leaf(f"{path}={value}", value, "Levanter's default"), rule(value, ctx), implied=True)


__all__ = ["NAME", "REFUSED", "RULES", "SECTIONS", "implied"]
