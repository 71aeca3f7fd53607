"""The split: which arguments go to DeepSpeed's config JSON and which to its runner's command line.

- :func:`deepspeed_config` builds the dict handed to ``deepspeed.initialize(config=...)``: batch sizes,
  precision blocks, ZeRO, clipping, printing and the other DeepSpeed blocks, plus
  ``deepspeed_extra_args``. The GPT-NeoX ``optimizer``/``scheduler`` blocks stay out: Deepy's
  trainer builds the optimizer and drives the LR schedule itself.
- :func:`runner_args` builds the flags for ``deepspeed.launcher.runner`` (hosts, ranks per node,
  rendezvous, multi-node launcher).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from megatron.errors import ConfigError
from megatron.neox_arguments.provenance import DERIVED

# Schema fields whose names are DeepSpeed config keys, copied when set (None means "leave out").
DS_CONFIG_KEYS: tuple[str, ...] = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "fp32_allreduce",
    "prescale_gradients",
    "gradient_predivide_factor",
    "fp16",
    "bf16",
    "gradient_clipping",
    "zero_optimization",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "flops_profiler",
    "communication_data_type",
    "autotuning",
    "activation_checkpointing",
    "data_efficiency",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "checkpoint",
    "data_types",
)

# Blocks DeepSpeed 0.19.8 removed and now rejects outright ("... has been removed"): GPT-NeoX's
# sparse_gradients, amp, curriculum_learning, sparse_attention, elasticity, compression_training.
# They are never copied into the config; a user who turns one on gets an error from the rules.
REMOVED_DEEPSPEED_KEYS: dict[str, str] = {
    "compression_training": "the compression library was removed",
    "amp": "Apex AMP was removed; use fp16 or bf16",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse compression of dense embedding gradients was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "sparse attention was removed",
    "elasticity": "elastic training was removed; set the batch sizes directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "legacy curriculum learning was removed",
    "progressive_layer_drop": "progressive layer dropping was removed",
    "nebula": "Nebula checkpointing was removed",
}
"""Top-level DeepSpeed config keys DeepSpeed 0.19.8 refuses (its ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``;
a unit test keeps this copy equal, so deepy.py need not import DeepSpeed)."""


# Keys Deepy checks or derives itself: setting them behind its back (inside deepspeed_extra_args)
# would bypass the batch/precision/ZeRO rules and make DeepSpeed disagree with the trainer.
OWNED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "zero_optimization",
        "gradient_clipping",
    }
)
# The trainer creates the optimizer and LR schedule; a DeepSpeed-built one would be a second one.
REFUSED_EXTRA_KEYS = {
    "optimizer": "Deepy builds the optimizer from optimizer_type/optimizer/lr",
    "scheduler": "Deepy drives the LR schedule from lr_decay_style/warmup/min_lr",
}


def _user_given(args: Any, key: str, provenance: Mapping[str, str] | None) -> bool:
    """Set by the user or by the rules, i.e. not silently at its schema default."""
    if provenance is not None and key in provenance:
        return True
    fields = getattr(type(args), "model_fields", {})
    default = fields[key].get_default(call_default_factory=True) if key in fields else None
    return getattr(args, key, None) != default


def extra_args_problems(args: Any, provenance: Mapping[str, str] | None = None) -> list[str]:
    """Keys of ``deepspeed_extra_args`` that clash with top-level keys or with what Deepy owns."""
    extra = getattr(args, "deepspeed_extra_args", None) or {}
    if not isinstance(extra, Mapping):
        return [f"deepspeed_extra_args must be a mapping of DeepSpeed config keys, got {extra!r}"]
    where = (provenance or {}).get("deepspeed_extra_args", "default")
    problems = []
    for key in extra:
        if key in REMOVED_DEEPSPEED_KEYS:
            problems.append(
                f"deepspeed_extra_args.{key} ({where}): DeepSpeed refuses it: {REMOVED_DEEPSPEED_KEYS[key]}"
            )
        elif key in REFUSED_EXTRA_KEYS:
            problems.append(
                f"deepspeed_extra_args.{key} ({where}): {REFUSED_EXTRA_KEYS[key]}; remove it"
            )
        elif key in DS_CONFIG_KEYS and _user_given(args, key, provenance):
            source = (provenance or {}).get(key, DERIVED)
            problems.append(
                f"{key} is given both as a top-level key ({source}) and in deepspeed_extra_args "
                f"({where}): keep the top-level key, which Deepy checks"
            )
        elif key in OWNED_KEYS:
            problems.append(
                f"deepspeed_extra_args.{key} ({where}): set {key} as a top-level key instead, so "
                f"Deepy's batch/precision/ZeRO rules see it"
            )
    return problems


def deepspeed_config(args: Any, provenance: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for ``args`` (already finalized)."""
    problems = extra_args_problems(args, provenance)
    if problems:
        raise ConfigError("\n".join(problems))
    config: dict[str, Any] = {}
    for key in DS_CONFIG_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            config[key] = dict(value) if isinstance(value, Mapping) else value
    zero = config.get("zero_optimization") or {}
    if int(zero.get("stage", 0) or 0) > 0:
        # The trainer hands DeepSpeed its own optimizer object; ZeRO refuses optimizers outside its
        # short tested list (Lion, SM3, ...) unless told otherwise.
        config["zero_allow_untested_optimizer"] = True
    config.update(dict(getattr(args, "deepspeed_extra_args", None) or {}))
    return config


def runner_args(args: Any) -> list[str]:
    """Flags for ``python -m deepspeed.launcher.runner`` (before the user script)."""
    out: list[str] = []
    for key in ("hostfile", "include", "exclude", "master_addr"):
        value = getattr(args, key, None)
        if value:
            out += [f"--{key}", str(value)]
    num_nodes = getattr(args, "num_nodes", -1)
    if num_nodes is not None and num_nodes > 0:
        out += ["--num_nodes", str(num_nodes)]
    num_gpus = getattr(args, "num_gpus", None)
    if num_gpus is not None:
        out += ["--num_gpus", str(num_gpus)]
    out += ["--master_port", str(getattr(args, "master_port", None) or 29500)]
    launcher = getattr(args, "launcher", None) or "pdsh"
    out += ["--launcher", launcher]
    # DeepSpeed's runner and per-node launcher log at INFO unless told otherwise
    out += ["--log_level", args.deepspeed_log_level]
    if getattr(args, "force_multi", False):
        out.append("--force_multi")
    if getattr(args, "no_ssh_check", False):
        out.append("--no_ssh_check")
    srun_flags = [
        f"--{key}={getattr(args, key)}" for key in ("comment", "account") if getattr(args, key, None)
    ]
    if srun_flags:
        # DeepSpeed 0.19.8's runner has no --comment/--account; srun takes them via --launcher_args
        if launcher != "slurm":
            raise ConfigError(
                f"comment/account only apply to srun: set launcher: slurm (now {launcher!r}) or remove them"
            )
        out += ["--launcher_args", shlex.join(srun_flags)]
    return out
