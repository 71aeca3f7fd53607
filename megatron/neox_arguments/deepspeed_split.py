"""The split: which arguments go to DeepSpeed's config JSON (the runner's command line is built by
:mod:`megatron.launcher`).

- :func:`deepspeed_config` builds the dict handed to ``deepspeed.initialize(config=...)``: batch sizes,
  precision blocks, ZeRO, clipping, printing and the other DeepSpeed blocks, plus
  ``deepspeed_extra_args``. The GPT-NeoX ``optimizer``/``scheduler`` blocks stay out: Deepy's
  trainer builds the optimizer and drives the LR schedule itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from megatron import devices
from megatron.errors import ConfigError
from megatron.config_rules import DERIVED, block_enabled

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

# Schema fields whose names are DeepSpeed config keys, copied when set (None means "leave out").
DS_CONFIG_KEYS: tuple[str, ...] = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
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
    "autotuning": "DeepSpeed's autotuner cannot run on Deepy's launch (see the autotuning key)",
    "data_efficiency": ("DeepSpeed acts on it only through its own data loader, which Deepy does not use; set "
                        "data_efficiency as a top-level key (its seqlen curriculum is Deepy's)"),
}


def _user_given(args: NeoXArgs, key: str, provenance: Mapping[str, str] | None) -> bool:
    """Set by the user or by the rules, i.e. not silently at its schema default."""
    if provenance is not None and key in provenance:
        return True
    default = type(args).model_fields[key].get_default(call_default_factory=True)
    return getattr(args, key) != default


def extra_args_problems(args: NeoXArgs, provenance: Mapping[str, str] | None = None) -> list[str]:
    """Keys of ``deepspeed_extra_args`` that clash with top-level keys or with what Deepy owns."""
    extra = args.deepspeed_extra_args or {}
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


def deepspeed_config(args: NeoXArgs, provenance: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for ``args`` (already finalized)."""
    problems = extra_args_problems(args, provenance)
    if problems:
        raise ConfigError("\n".join(problems))
    config: dict[str, Any] = {}
    for key in DS_CONFIG_KEYS:
        value = getattr(args, key)
        if value is not None:
            config[key] = dict(value) if isinstance(value, Mapping) else value
    if args.fp32_allreduce and "communication_data_type" not in config:
        # GPT-NeoX's fp32_allreduce is DeepSpeed's communication_data_type: fp32 (DeepSpeed 0.19.8 has
        # no fp32_allreduce key of its own and would ignore it)
        config["communication_data_type"] = "fp32"
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if isinstance(stage, int) and stage > 0:
        # The trainer hands DeepSpeed its own optimizer object; ZeRO refuses optimizers outside its
        # short tested list (Lion, SM3, ...) unless told otherwise.
        config["zero_allow_untested_optimizer"] = True
    gpu_defaults(config)
    config.update(dict(args.deepspeed_extra_args or {}))
    return config


def gpu_defaults(config: dict[str, Any]) -> None:
    """Settings DeepSpeed 0.19.8 defaults otherwise, which cost accuracy or speed on a GPU; a key the
    user set (top level or in ``deepspeed_extra_args``) wins.

    - bf16 gradients are accumulated and all-reduced in fp32 (Megatron-LM does the same for bf16 unless
      told ``--grad-reduce-in-bf16``: megatron/training/arguments.py at 307dcf3; GPT-NeoX's own 7B/34B
      llemma configs set ``grad_accum_dtype: fp32`` at ea7aefd):
      DeepSpeed's defaults are the model dtype for both, so a sum over micro-batches and ranks loses
      bf16's 8 bits of mantissa. ``communication_data_type: fp32`` everywhere; ``data_types.grad_accum_dtype:
      fp32`` under ZeRO 1-3 (stage 1 then runs DeepSpeed's bf16 optimizer, which keeps an fp32
      gradient buffer; 2 and 3 keep fp32 gradient partitions). Without ZeRO DeepSpeed refuses the key
      ("unsupported mix" for the plain engine); a pipeline's bf16 optimizer accumulates in fp32 already.
    - DeepSpeed's throughput timer is off: it synchronises the device at the start and the end of
      every micro-batch (two host syncs each) to print a samples/s line Deepy does not show; Deepy's
      ``throughput/*`` metrics time whole logging windows.
    """
    if block_enabled(config.get("bf16")):
        config.setdefault("communication_data_type", "fp32")
        zero = config.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
        types = dict(config.get("data_types") or {})
        if isinstance(stage, int) and stage > 0 and "grad_accum_dtype" not in types:
            config["data_types"] = {**types, "grad_accum_dtype": "fp32"}
    config.setdefault("timers", {"throughput": {"enabled": False}})


# DeepSpeed's pydantic config models -> the config key that holds them
_DEEPSPEED_BLOCK_OF_MODEL = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFlopsProfilerConfig": "flops_profiler",
    "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
    "DeepSpeedMonitorConfig": "tensorboard/wandb/csv_monitor",
    "TensorBoardConfig": "tensorboard",
    "WandbConfig": "wandb",
    "CSVConfig": "csv_monitor",
    "CommsConfig": "comms_logger",
    "CommsLoggerConfig": "comms_logger",
}


def _deepspeed_config_class() -> Any:
    """DeepSpeed's config parser, imported without its accelerator-detection banner on stdout.

    DeepSpeed prints a warning when it guesses the accelerator; naming it for this process's
    import (and restoring the environment after) keeps deepy.py's output to our lines. The ranks
    are other processes and detect their own devices.
    """
    previous = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = previous or ("cuda" if devices.gpu_count() else "cpu")
    try:
        # lazy: DeepSpeed, only when its parser has not accepted this config before
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.config import DeepSpeedConfig

        get_accelerator()  # resolved and cached now, while the variable is set
    finally:
        if previous is None:
            os.environ.pop("DS_ACCELERATOR", None)
    return DeepSpeedConfig


def accepted_config_marker(config: Mapping[str, Any]) -> Path | None:
    """Where deepy.py records that this DeepSpeed installation accepted ``config`` (None: no cache).

    Asking DeepSpeed's parser means importing DeepSpeed and torch, about 2 s of every launch; its
    answer depends only on the config, DeepSpeed's version and the accelerator, so an accepted
    config is remembered under ``$XDG_CACHE_HOME/deepy`` (``~/.cache/deepy``) by a hash of those.
    Refusals are never remembered: they are asked again and reported every time.
    ``DEEPY_NO_CACHE=1`` turns this off.
    """
    if os.environ.get("DEEPY_NO_CACHE", "") not in ("", "0"):
        return None
    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None
    key = json.dumps([version, os.environ.get("DS_ACCELERATOR", ""), devices.gpu_driver_present(), config],
                     sort_keys=True, default=str)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepy" / "deepspeed-accepted"
    return root / hashlib.sha256(key.encode()).hexdigest()


def deepspeed_problems(config: Mapping[str, Any], provenance: Mapping[str, str] | None = None) -> list[str]:
    """What DeepSpeed's own config parser refuses in ``config`` (bad numbers or keys inside the
    fp16/bf16/ZeRO/... blocks), as messages naming the block and where it was set.

    The batch sizes are left out: Deepy's rules check them against the real data-parallel size,
    which DeepSpeed's parser cannot know without a process group.
    """
    checked = {k: v for k, v in config.items() if k != "train_batch_size"}
    marker = accepted_config_marker(checked)
    if marker is not None and marker.exists():
        return []
    problems = _parser_problems(checked, provenance)
    if not problems and marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass  # a read-only home: the parser is asked again next time
    return problems


def _parser_problems(checked: Mapping[str, Any], provenance: Mapping[str, str] | None) -> list[str]:
    DeepSpeedConfig = _deepspeed_config_class()
    try:
        DeepSpeedConfig(dict(checked))
    except ValidationError as err:
        block = _DEEPSPEED_BLOCK_OF_MODEL.get(err.title, err.title)
        top = block.split(".")[0].split("/")[0]
        where = (provenance or {}).get(top, "derived")
        return [
            f"{block}.{'.'.join(str(p) for p in item['loc'])} = {item.get('input')!r} ({where}): "
            f"DeepSpeed refuses it: {item['msg']}"
            for item in err.errors()
        ]
    except (ValueError, AssertionError, KeyError, TypeError) as err:
        return [f"DeepSpeed refuses the generated config: {type(err).__name__}: {err}"]
    return []
