"""Levanter's ``trainer:`` section: ``TrainerConfig``, its ``CheckpointerConfig`` and tracker configs.

Defaults and meanings are read from stanford-crfm/levanter at 9263f81e: ``TrainerConfig``
(``src/levanter/trainer.py``), ``CheckpointerConfig`` (``src/levanter/checkpoint.py``), ``WandbConfig``
(``src/levanter/tracker/wandb.py``) and ``TensorboardConfig`` (``src/levanter/tracker/tensorboard.py``).
JAX's mesh keys are accepted at values that describe Deepy's own layout (and become the sharding they
mean); JAX and TPU plumbing that changes nothing here is accepted at its defaults and said so.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

from megatron import devices
from megatron.checkpointing.discovery import inspect_load_dir
from megatron.checkpointing.remote import remote_resume_point
from megatron.neox_arguments.dialects.common import Context, Refused, Rule, noted, to
from megatron.object_store import is_remote

CHECKPOINTER_DEFAULTS: dict[str, Any] = {"base_path": "checkpoints/", "save_interval": "15min",
                                         "keep": [{"every": 10000}], "append_run_id_to_base_path": True}
"""``CheckpointerConfig``'s defaults: a Levanter run always saves (every 15 minutes, keeping every 10,000th step)."""

TP_AXES = frozenset({"mlp", "heads", "kv_heads", "vocab"})
"""The logical axes Deepy's tensor parallelism splits (Megatron's layout: heads, MLP, vocabulary)."""

# ------------------------------------------------------------------------------------- precision

_DTYPES = {"f32": "fp32", "float32": "fp32", "full": "fp32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "f16": "fp16", "float16": "fp16", "half": "fp16"}
_POLICY_KEYS = {"p": "p", "params": "p", "c": "c", "compute": "c", "o": "o", "output": "o"}


BF16_EVERYWHERE: dict[str, Any] = {"enabled": True, "bf16_master_weights_and_grads": True,
                                   "bf16_optimizer_states": True}
"""DeepSpeed's bf16 block for one dtype everywhere: ZeRO keeps its (partitioned) weights and gradients
in bf16 and Adam's moments follow them (deepspeed/runtime/base_optimizer.py ``_configure_master_weights``,
0.19.8); DeepSpeed allows it under ZeRO 1-3 only (runtime/config.py:706-714)."""


def _mixed_precision(value: Any, ctx: Context) -> dict[str, Any]:
    """jmp's policy string: ``p=f32,c=bfloat16`` or one dtype for everything (``bfloat16`` keeps even
    the parameters in bf16)."""
    text = str(value).replace(" ", "")
    policy: dict[str, str] = {}
    if "=" not in text:
        policy = {"p": text, "c": text, "o": text}
    else:
        for part in text.split(","):
            key, _, dtype = part.partition("=")
            if key not in _POLICY_KEYS:
                raise Refused(f"unknown mixed-precision part {key!r}; write p=...,c=...")
            policy[_POLICY_KEYS[key]] = dtype
    for dtype in policy.values():
        if dtype not in _DTYPES:
            raise Refused(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    compute = _DTYPES[policy.get("c", "f32")]
    if "o" in policy and _DTYPES[policy["o"]] != compute:
        raise Refused("the output dtype (o=) follows the compute dtype here; leave o= out or set it equal to c=")
    params = _DTYPES[policy.get("p", "f32")]
    if params == "fp32":
        return {"precision": compute}
    if params != "bfloat16" or compute != "bfloat16":
        raise Refused(f"jmp policy {value!r} keeps the parameters in {params} and computes in {compute}; Deepy "
                      f"keeps parameters in fp32 (p=f32,c=...) or everything in bf16 (bfloat16)")
    # jmp's "bfloat16": params, compute and output bf16; optax's adam keeps its moments in the params'
    # dtype (mu_dtype None), so no fp32 copy exists anywhere
    if ctx.value("trainer.fsdp_axis", "embed") in (None, []):
        raise Refused("parameters and Adam's moments in bf16 need ZeRO 1-3 in DeepSpeed 0.19.8 (its "
                      "bf16_master_weights_and_grads); fsdp_axis: null replicates them (no ZeRO): keep "
                      "Levanter's fsdp_axis embed, or write p=f32,c=bfloat16")
    return {"precision": "bfloat16", "bf16": dict(BF16_EVERYWHERE)}


# ------------------------------------------------------------------------------------ run id, paths


def run_id(ctx: Context) -> str:
    """Levanter's run id: ``trainer.id``, else the W&B tracker's id, else a fresh 8-character one."""
    for key in ("trainer.id", "trainer.wandb.id", "trainer.tracker.id"):
        if ctx.value(key):
            return str(ctx.value(key))
    return _fresh_id()


_FRESH: list[str] = []


def _fresh_id() -> str:
    if not _FRESH:  # one id per process, so every rule of one translation sees the same
        _FRESH.append(secrets.token_hex(4))
    return _FRESH[0]


def checkpoint_dir(ctx: Context) -> str:
    base = str(ctx.value("trainer.checkpointer.base_path", CHECKPOINTER_DEFAULTS["base_path"]))
    if ctx.value("trainer.checkpointer.append_run_id_to_base_path", True):
        return os.path.join(base, run_id(ctx))
    return base


def _has_checkpoint(path: str) -> bool:
    if is_remote(path):  # a bucket: its committed checkpoints (an unreachable one is refused by the `load` check)
        try:
            return remote_resume_point(path) is not None
        except Exception:  # noqa: BLE001 - the store's own errors; the check before launch names them
            return False
    return inspect_load_dir(Path(path)).kind in ("deepy", "deepy_tag")


def checkpoint_paths(ctx: Context) -> dict[str, Any]:
    """``save`` = ``base_path/<run id>``; ``load`` = ``load_checkpoint_path`` or that same directory, or
    ``initialize_from`` when this run has no checkpoint of its own yet (``Trainer.initial_state``)."""
    save = checkpoint_dir(ctx)
    load = ctx.value("trainer.load_checkpoint_path") or save
    values: dict[str, Any] = {"save": save, "load": load}
    mode = ctx.value("trainer.load_checkpoint")
    start = ctx.value("trainer.initialize_from")
    if mode is not True and start and not _has_checkpoint(load):
        values["load"] = str(start)  # Levanter continues the other run: its weights, optimizer and step
    elif mode is True and not _has_checkpoint(load):
        raise Refused(f"load_checkpoint: true, but {load} holds no checkpoint (Levanter stops here too)")
    return values


def _load_checkpoint(value: Any, ctx: Context) -> dict[str, Any]:
    out = checkpoint_paths(ctx)
    if value is False:
        out["load_checkpoint"] = False
    return out


# ----------------------------------------------------------------------------------- trackers

TENSORBOARD_DEFAULTS: dict[str, Any] = {"comment": "", "purge_step": None, "max_queue": 10, "flush_secs": 120,
                                        "filename_suffix": "", "write_to_disk": True}
"""TensorboardConfig's writer settings, accepted at these defaults (what Deepy's writer does)."""

_WANDB_FIELDS = {"project": "project", "entity": "entity", "name": "name", "group": "group", "tags": "tags",
                 "notes": "notes", "mode": "mode", "id": "id"}


def _tracker_from(spec: dict[str, Any], ctx: Context) -> dict[str, Any] | None:
    kind = str(spec.get("type", "wandb"))
    if kind == "noop":
        return None
    if kind == "tensorboard":
        extra = set(spec) - {"type", "logdir", *TENSORBOARD_DEFAULTS}
        if extra:
            raise Refused(f"{sorted(extra)} are not fields of Levanter's TensorboardConfig")
        changed = sorted(k for k, v in spec.items() if k in TENSORBOARD_DEFAULTS and v != TENSORBOARD_DEFAULTS[k])
        if changed:
            raise Refused(f"TensorBoard writer settings {changed} are not built here (Deepy's writer keeps "
                          f"SummaryWriter's defaults, and purges a resumed run's later events itself)")
        # TensorboardConfig.init writes to <logdir>/<run id>
        return {"type": "tensorboard", "logdir": os.path.join(str(spec.get("logdir") or "tblogs"), run_id(ctx))}
    if kind != "wandb":
        raise Refused(f"tracker type {kind!r} is not built here; use wandb, tensorboard or noop")
    block: dict[str, Any] = {"type": "wandb", "project": "levanter"}  # WandbConfig.project's default
    for key, value in spec.items():
        if key in ("type", "resume", "save_xla_dumps", "save_code"):
            continue  # read by their own rules (save_code: wandb_code_dir)
        if key not in _WANDB_FIELDS:
            raise Refused(f"W&B field {key!r} is not read here; Deepy reads {', '.join(_WANDB_FIELDS)}, resume")
        if value is not None:
            block[_WANDB_FIELDS[key]] = list(value) if key == "tags" else value
    block.setdefault("id", run_id(ctx))
    return block


def tracker_block(ctx: Context) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The tracker(s) of ``trainer.wandb.*`` / ``trainer.tracker`` as Deepy's ``tracker`` key; with
    neither, Levanter's default ``WandbConfig()`` (project ``levanter``)."""
    for prefix in ("trainer.tracker", "trainer.wandb"):
        whole = ctx.value(prefix)
        if isinstance(whole, list):
            blocks = [b for b in (_tracker_from(dict(item), ctx) for item in whole) if b is not None]
            return blocks or None
        spec = {path[len(prefix) + 1:]: leaf.value for path, leaf in ctx.leaves.items() if path.startswith(prefix + ".")}
        if spec or (whole is not None and prefix in ctx.leaves):
            if prefix == "trainer.wandb":
                spec.setdefault("type", "wandb")
            return _tracker_from(spec, ctx)
    return _tracker_from({}, ctx)


def _tracker(value: Any, ctx: Context) -> dict[str, Any]:
    block = tracker_block(ctx)
    out: dict[str, Any] = {"tracker": block if block is not None else []}
    for prefix in ("trainer.tracker", "trainer.wandb"):
        whole = ctx.value(prefix)
        if isinstance(whole, list):  # a list's entries are no leaves of their own: their save_code is read here
            wandb = [dict(item) for item in whole if str(dict(item).get("type", "wandb")) == "wandb"]
            out["wandb_code_dir"] = code_dir(wandb[0].get("save_code", True)) if wandb else None
    return out


def _resume(value: Any, ctx: Context) -> dict[str, Any]:
    if value in (True, "allow", "auto", "must", None):
        return _tracker(value, ctx)  # what Deepy does: a resumed checkpoint continues its W&B run
    raise Refused("Deepy always continues the W&B run of the checkpoint it resumes; leave resume out or true")


ENVIRONMENT_DIRS = ("site-packages", "dist-packages", "venv", "opt/homebrew", "conda", "pyenv")
"""Directories that ``infer_experiment_git_root`` skips as a Python environment's (tracker/helpers.py:63@9263f81e)."""

TRAIN_SCRIPT_DIR = Path(__file__).resolve().parents[3]
"""The directory of the training script Deepy launches (train.py, at the repository's root)."""


@functools.cache  # one answer per process: every rule of a translation asks
def experiment_git_root(script_dir: Path = TRAIN_SCRIPT_DIR) -> str | None:
    """Levanter's ``infer_experiment_git_root`` (tracker/helpers.py:51-73@9263f81e) for Deepy's training
    script: the root of the git work tree holding the script's directory, unless that directory is in a
    Python environment; None when there is none."""
    if any(part in str(script_dir) for part in ENVIRONMENT_DIRS):
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=script_dir, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    root = out.stdout.strip()
    return root if out.returncode == 0 and root else None


def code_dir(save_code: Any) -> str | None:
    """``WandbConfig.save_code`` (tracker/wandb.py:156, 245-256@9263f81e) -> ``wandb_code_dir``: a string is
    that directory; true the experiment's git root, else "." (made absolute before launch); false none."""
    if save_code is None or isinstance(save_code, bool):
        return (experiment_git_root() or ".") if save_code else None
    if isinstance(save_code, str):
        return save_code
    raise Refused(f"save_code is true, false or a directory, not {save_code!r}")


def _save_code(value: Any, ctx: Context) -> dict[str, Any]:
    return {**_tracker(value, ctx), "wandb_code_dir": code_dir(value)}


def implied_code_dir(tracker: Any) -> dict[str, Any]:
    """Levanter's default ``save_code: true`` for a W&B tracker that does not say (WandbConfig's default)."""
    blocks = tracker if isinstance(tracker, list) else [tracker] if tracker else []
    return {"wandb_code_dir": code_dir(True)} if any(dict(b).get("type") == "wandb" for b in blocks) else {}


def _id(value: Any, ctx: Context) -> dict[str, Any]:
    return {**checkpoint_paths(ctx), **_tracker(value, ctx)}


# -------------------------------------------------------------------------------------- the mesh


def _batch_axis(value: Any, ctx: Context) -> dict[str, Any]:
    if value != "batch":
        raise Refused("Deepy splits the batch over its data-parallel ranks: the batch axis is Levanter's 'batch'")
    return noted("the batch is split over the data-parallel ranks, as Levanter's batch axis is")


def fully_sharded(ctx: Context) -> dict[str, Any]:
    """Parameters, gradients and optimizer states sharded over the data-parallel ranks: ZeRO-3; beside
    tensor parallelism (which Deepy does not combine with ZeRO-3) the gradients and optimizer states
    only, ZeRO-2, and the dry run says so."""
    if int(ctx.value("trainer.model_axis_size", 1)) > 1:
        return {"zero_stage": 2, **noted("with model_axis_size > 1 Deepy shards the gradients and optimizer states "
                                         "over the data axis (ZeRO-2); its tensor parallelism does not combine "
                                         "with ZeRO-3, so the parameters stay whole on each data rank")}
    return {"sharding_strategy": "fsdp"}


def _fsdp_axis(value: Any, ctx: Context) -> dict[str, Any]:
    """Levanter shards every parameter (and its optimizer state) over the data axis along ``fsdp_axis``
    (default ``embed``): ZeRO-3 over the data-parallel ranks. ``null`` replicates them."""
    if value is None or value == []:
        return {"sharding_strategy": "ddp"}
    axes = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(axis, str) for axis in axes):
        raise Refused("fsdp_axis is an axis name or a list of them")
    return fully_sharded(ctx)


def _tensor_parallel_axes(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        if int(ctx.value("trainer.model_axis_size", 1)) > 1:
            raise Refused("with no tensor_parallel_axes Levanter shards nothing over its model axis; Deepy's "
                          "model_axis_size splits heads, MLP and vocabulary: give [mlp, heads]")
        return noted("no tensor parallelism, as model_axis_size 1 says")
    extra = set(value) - TP_AXES
    if extra:
        raise Refused(f"Deepy's tensor parallelism splits {', '.join(sorted(TP_AXES))}, not {sorted(extra)} "
                      f"(sequence splitting is context_parallel_size in a GPT-NeoX config)")
    return noted("Deepy's tensor parallelism (model_axis_size) splits the heads, the MLP and the vocabulary")


def _axis_resources(value: Any, ctx: Context, parameters: bool = False) -> dict[str, Any]:
    """A logical -> physical mapping: ``batch``/``token`` over data (or replica+data), ``embed`` over
    data (FSDP), the tensor-parallel axes over model."""
    if not value:
        return noted("an empty mapping: Levanter's default layout")
    out: dict[str, Any] = {}
    for axis, resource in dict(value).items():
        physical = [resource] if isinstance(resource, str) else list(resource)
        # token: Mixtral's flattened batch x position axis (mixtral.py:430@9263f81e), split as the batch is
        if axis in ("batch", "token") and not parameters and set(physical) <= {"replica", "data"}:
            continue
        if axis == "embed" and physical == ["data"]:
            out.update(fully_sharded(ctx))
            continue
        if axis in TP_AXES and physical == ["model"]:
            continue
        raise Refused(f"{axis}: {resource} is not a layout Deepy has (batch over data, embed over data = "
                      f"ZeRO-3, heads/mlp/vocab over model = tensor parallelism)")
    return out or noted("the layout Deepy's data and tensor parallelism already have")


def _train_batch_size(value: Any, ctx: Context) -> dict[str, Any]:
    """A number, or Levanter's schedule ``[{start, value}, ...]`` (``ScheduleStep``, schedule.py:13-16
    @9263f81e; ``TrainerConfig.train_batch_size: int | IntSchedule``, trainer.py:694) ->
    ``train_batch_size_schedule`` (step s takes the last entry with start <= s, schedule.py:98-106)."""
    if value == -1:
        # trainer.py:922-923,934-935@9263f81e: -1 is per_device_parallelism x the data axis (no accumulation);
        # both -1 is Levanter's ValueError
        micro = ctx.value("trainer.per_device_parallelism", ctx.value("trainer.per_device_train_parallelism", -1))
        if micro in (-1, None):
            raise Refused("-1 with per_device_parallelism -1: Levanter raises 'either train_batch_size or "
                          "per_device_parallelism must be specified (not -1)' (trainer.py:922-923)")
        return {"gradient_accumulation_steps": 1}  # with the micro batch, Deepy's batch is micro x data ranks
    if not isinstance(value, list):
        return {"train_batch_size": value}
    if not value or not all(isinstance(e, dict) and set(e) == {"start", "value"} for e in value):
        raise Refused("a batch schedule is a list of {start: step, value: batch size}")
    steps = [{"start_step": e["start"], "global_batch": e["value"]} for e in value]
    out: dict[str, Any] = {"train_batch_size_schedule": steps}
    micro = ctx.value("trainer.per_device_parallelism", ctx.value("trainer.per_device_train_parallelism", -1))
    if micro in (-1, None):
        # Levanter with -1 runs each step's batch whole, no accumulation (trainer.py:925-932); Deepy keeps one
        # micro batch: micro x dp = the sizes' greatest common divisor, and accumulates (the same mean gradient)
        sizes = [int(e["value"]) for e in value if isinstance(e["value"], int)]
        out["gradient_accumulation_steps"] = sizes[0] // math.gcd(*sizes) if len(sizes) == len(value) else 1
        if ctx.value("trainer.per_device_eval_parallelism", -1) in (-1, None):
            raise Refused("with a batch schedule and per_device_parallelism -1 Levanter's evaluation batch is the "
                          "largest scheduled batch (trainer.py:954-959); give trainer.per_device_eval_parallelism")
    return out


def _nondivisible(value: Any, ctx: Context) -> dict[str, Any]:
    """Levanter's flag only lets a batch that the data axis does not divide through, padded
    (data/loader.py:138-146, 180-190@9263f81e); a batch that divides is read the same either way."""
    return noted("Deepy's batches divide over the data-parallel ranks, where the flag changes nothing; one that "
                 "does not is refused before launch (train_batch_size, train_batch_size_schedule)")


def _micro_batch(value: Any, ctx: Context) -> dict[str, Any]:
    if value in (-1, None):
        return eval_micro_batch(ctx)  # Levanter's -1: the whole batch per step, derived from train_batch_size
    return {"train_micro_batch_size_per_gpu": value, **eval_micro_batch(ctx)}


def eval_micro_batch(ctx: Context) -> dict[str, Any]:
    """Levanter's eval batch is per_device_eval_parallelism x the data axis, with no accumulation
    (trainer.py:808-810@9263f81e); -1 takes per_device_parallelism, or (that -1 too) the train batch
    over the data axis (trainer.py:954-963), which is Deepy's default of one global batch."""
    value = ctx.value("trainer.per_device_eval_parallelism", -1)
    if value in (-1, None):
        value = ctx.value("trainer.per_device_parallelism", ctx.value("trainer.per_device_train_parallelism", -1))
    if value in (-1, None):
        return {}
    return {"eval_micro_batch_size_per_gpu": int(value)}


def _eval_micro_batch(value: Any, ctx: Context) -> dict[str, Any]:
    return eval_micro_batch(ctx) or noted("-1 with per_device_parallelism -1: one training batch per "
                                           "evaluation batch, as Deepy does")


def _eval_batches(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return noted("Levanter evaluates the whole validation set; Deepy evaluates eval_iters (100) batches of "
                     "its validation stream (docs/dialects.md, differences)")
    return {"eval_iters": value}


def _profile_stop(value: Any, ctx: Context) -> dict[str, Any]:
    start = ctx.value("trainer.profiler_start_step", 5)
    return {"profile_step_start": start, "profile_step_stop": start + int(value)}


def _equal_or_refuse(default: Any, reason: str, why: str = "Levanter's default, what Deepy does") -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if value != default and not (default is None and value in ({}, [])):
            raise Refused(reason)
        return noted(why)
    return rule


def _no_effect(reason: str) -> Rule:
    return lambda value, ctx: noted(reason)


def _ray(value: Any, ctx: Context) -> dict[str, Any]:
    """``RayConfig`` (distributed.py:376-384@9263f81e): with ``auto_start_cluster`` (default true) Levanter joins the
    Ray cluster at ``address`` (or starts one), on which it builds its token cache (store/cache.py). Here Ray only
    tokenizes: ``address`` -> ``tokenize_ray_address``; the ranks are Deepy's launcher's (``start_workers`` sets
    nothing)."""
    spec = dict(value or {})
    unknown = sorted(set(spec) - {"address", "start_workers", "auto_start_cluster"})
    if unknown:
        raise Refused(f"{unknown} are not fields of Levanter's RayConfig (address, start_workers, auto_start_cluster)")
    address = spec.get("address")
    if address is None:
        return noted("no Ray address: the cache of train_urls is tokenized by the rank that builds it (the same "
                     "bytes); Deepy launches its ranks itself (num_gpus, num_nodes, hostfile)")
    if not spec.get("auto_start_cluster", True):
        return noted("Levanter joins no cluster when auto_start_cluster is false (distributed.py:382-384)")
    return {"tokenize_ray_address": str(address)}


def _require_accelerator(value: Any, ctx: Context) -> dict[str, Any]:
    if value:
        if devices.gpu_count() == 0:
            raise Refused("no GPU here, and Levanter stops without an accelerator when this is true: set it false "
                          "to train on CPU")
    return noted("Deepy trains on the GPUs it finds, else on CPU")


def _quantization(value: Any, ctx: Context) -> dict[str, Any]:
    if value:
        kinds = ", ".join(k for k, v in dict(value).items() if v) if isinstance(value, dict) else str(value)
        raise Refused(f"quantised training ({kinds}; Levanter's fp8/int8 dot products) is not built here")
    return {}


def _model_averaging(value: Any, ctx: Context) -> dict[str, Any]:
    """``{type: ema, beta}`` (``EmaModelAveragingConfig``, beta 0.999 by default) -> ``ema_beta``."""
    if not value:
        return {}
    spec = dict(value) if isinstance(value, dict) else {"type": value}
    kind = spec.pop("type", "ema")
    if kind != "ema":
        raise Refused(f"model averaging {kind!r} (the EMA followed by a 1 - sqrt decay) is not built here; "
                      "type: ema is (ema_beta)")
    beta = spec.pop("beta", 0.999)
    if spec:
        raise Refused(f"EmaModelAveragingConfig has no {', '.join(map(str, spec))}; it has beta")
    return {"ema_beta": float(beta)}


TRACKER_PATHS = [*(f"trainer.{p}.{f}" for p in ("wandb", "tracker") for f in _WANDB_FIELDS),
                 "trainer.tracker.type", "trainer.tracker.logdir",
                 *(f"trainer.tracker.{f}" for f in ("comment", "purge_step", "max_queue", "flush_secs",
                                                     "filename_suffix", "write_to_disk"))]

TRAINER_RULES: dict[str, Rule] = {
    "trainer.seed": to("seed"),
    "trainer.num_train_steps": to("train_iters"),
    "trainer.train_batch_size": _train_batch_size,
    "trainer.per_device_parallelism": _micro_batch,
    "trainer.per_device_train_parallelism": _micro_batch,
    "trainer.per_device_eval_parallelism": _eval_micro_batch,
    "trainer.allow_nondivisible_batch_size": _nondivisible,
    "trainer.steps_per_eval": to("eval_interval"),
    "trainer.max_eval_batches": _eval_batches,
    "trainer.mp": _mixed_precision,
    "trainer.quantization": _quantization,
    "trainer.model_averaging": _model_averaging,
    "trainer.model_axis_size": to("model_parallel_size"),
    "trainer.replica_ici_axis_size": _equal_or_refuse(1, "replicas of the FSDP group within a slice are not "
                                                         "mapped; use 1"),
    "trainer.replica_dcn_axis_size": _equal_or_refuse(1, "multi-slice replicas are not mapped; use 1"),
    "trainer.batch_axis": _batch_axis,
    "trainer.fsdp_axis": _fsdp_axis,
    "trainer.tensor_parallel_axes": _tensor_parallel_axes,
    "trainer.axis_resources": _axis_resources,
    "trainer.parameter_axis_resources": lambda v, ctx: _axis_resources(v, ctx, parameters=True),
    "trainer.id": _id,
    "trainer.log_dir": to("log_dir"),
    "trainer.load_checkpoint": _load_checkpoint,
    "trainer.load_checkpoint_path": lambda v, ctx: checkpoint_paths(ctx),
    "trainer.initialize_from": lambda v, ctx: checkpoint_paths(ctx),
    "trainer.allow_partial_checkpoint": _equal_or_refuse(False, "a checkpoint holds every parameter here"),
    "trainer.checkpointer.base_path": lambda v, ctx: checkpoint_paths(ctx),
    "trainer.checkpointer.append_run_id_to_base_path": lambda v, ctx: checkpoint_paths(ctx),
    "trainer.checkpointer.save_interval": to("save_interval"),
    "trainer.checkpointer.keep": to("keep"),
    "trainer.checkpointer.delete_old_temp_checkpoints": _equal_or_refuse(
        True, "Deepy replaces each temporary (save_interval) checkpoint by the next one",
        "Deepy replaces each temporary (save_interval) checkpoint by the next one"),
    "trainer.profiler": to("profile"),
    "trainer.profiler_start_step": lambda v, ctx: {"profile_step_start": v},
    "trainer.profiler_num_steps": _profile_stop,
    "trainer.profiler_perfetto_link": _equal_or_refuse(False, "Perfetto links are not made here"),
    "trainer.log_jaxprs": _no_effect("JAX's traced programs; Deepy runs on PyTorch"),
    "trainer.log_xla_hlo": _no_effect("XLA's compiled programs; Deepy runs on PyTorch"),
    "trainer.jax_config": _no_effect("JAX runtime flags; Deepy runs on PyTorch"),
    "trainer.jax_compilation_cache_dir": _no_effect("JAX's compile cache; Deepy runs on PyTorch"),
    "trainer.ray": _ray,
    "trainer.require_accelerator": _require_accelerator,
    "trainer.shutdown_at_exit": _equal_or_refuse(False, "a TPU VM shutdown hook is not built here"),
    "trainer.tracker": _tracker,
    "trainer.wandb": _tracker,
    "trainer.wandb.resume": _resume,
    "trainer.tracker.resume": _resume,
    "trainer.wandb.save_code": _save_code,
    "trainer.tracker.save_code": _save_code,
    "trainer.wandb.save_xla_dumps": _equal_or_refuse(False, "XLA dumps; Deepy runs on PyTorch"),
    "trainer.tracker.save_xla_dumps": _equal_or_refuse(False, "XLA dumps; Deepy runs on PyTorch"),
    **{path: _tracker for path in TRACKER_PATHS},
}

TRAINER_REFUSED: dict[str, str] = {
    "trainer.distributed": "JAX's cluster discovery; Deepy's launcher sets up torch.distributed (num_nodes, "
                           "hostfile, master_port)",
    "trainer.watch": "Levanter's parameter/gradient histograms are not built here",
    "trainer.mesh": "not a TrainerConfig field at Levanter 9263f81e",
}

KEEP_WHOLE = frozenset({"trainer.jax_config", "trainer.ray", "trainer.axis_resources", "trainer.quantization",
                        "trainer.model_averaging", "trainer.parameter_axis_resources"})
"""Mappings read as a whole (their entries are not keys of their own)."""
