"""The weights generate.py and eval.py run: the newest committed checkpoint in `load`.

Inference needs the model, not the training engine: the model is built as training builds it (plain
`GPTModel` or this rank's `PipelineModule` stage, `megatron.engine.build.build_model`) but without an
optimizer, an LR schedule or `deepspeed.initialize`. Its weights come from the offline reader the HF export
uses (`megatron.interop.deepy_checkpoint.read_full_checkpoint`: any tp, plain or pipeline, ZeRO 0-3), fitted
to this run's padded vocabulary and cut to this rank's tensor-parallel shard (:func:`load_full_weights`).

LoRA adapters are applied as trained: their settings (rank, alpha, targets) come from the checkpoint's recorded
arguments, not from the config (:func:`saved_lora`), the model is built with them and the reader returns their
tensors. Experts that are not split over data-parallel ranks are ordinary tensor-parallel weights. Cases that reader
does not cover keep the old path, the training engine loading the checkpoint in
weights-only mode through the checkpoint loader (universal checkpoint conversion when the layout changed);
:func:`engine_needed` names each one and why.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron.checkpointing.commit import step_of
from megatron.checkpointing.expert_shards import EP_KEY
from megatron.checkpointing.local_weights import local_weights
from megatron.checkpointing.save_load import LoadOptions, load_checkpoint, read_meta, resolve_tag
from megatron.checkpointing.universal import Layout
from megatron.errors import CheckpointError
from megatron.interop.deepy_checkpoint import Weights, read_full_checkpoint
from megatron.model import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.model.partitioning import tp_partition_of

log = logging.getLogger("deepy.checkpoint")

INFERENCE_OVERRIDES: dict[str, Any] = {
    # the KV cache cannot split the sequence; sequence parallelism changes no weight
    "sequence_parallel": False,
    # no backward pass, so nothing to recompute
    "checkpoint_activations": False,
    "selective_checkpointing": None,
    "partition_activations": False,
}
"""Settings the inference model is built with whatever the training config said."""


def committed_checkpoint(load: str | None, iteration: int | None, script: str) -> Path:
    """The tag directory of `load`'s newest committed checkpoint (or of `iteration`)."""
    if not load:
        raise CheckpointError(f"{script} needs `load`: the directory of a trained checkpoint (its weights are used)")
    load_dir = Path(load)
    tag, warnings = resolve_tag(load_dir, iteration)
    for warning in warnings:
        log.warning(warning)
    if tag is None:
        raise CheckpointError(f"{script}: no committed checkpoint in {load_dir}; train first, or point `load` "
                              "at a directory that holds one")
    return load_dir / tag


def engine_needed(ckpt: Path, expert_parallel: int) -> str | None:
    """Why the checkpoint at `ckpt` must be loaded through the training engine when this run splits experts
    over `expert_parallel` data-parallel ranks; None when the weights-only reader covers it."""
    meta = read_meta(ckpt)  # a checkpoint without Deepy's metadata (GPT-NeoX's own) is refused here, by name
    saved_expert_parallel = int((meta.get("args") or {}).get(EP_KEY) or 1)
    if max(expert_parallel, saved_expert_parallel) > 1:
        # each expert-parallel rank's experts are in its own deepy_experts/ file, which the full-weights reader
        # does not read, and only the engine places them on the ranks that hold them (checkpointing/expert_shards.py)
        return "experts split over data-parallel ranks (moe_expert_parallel_size > 1)"
    layout = Layout.from_dict(meta["layout"])
    if layout.zero_stage == 3 and layout.tp > 1:
        # zero_to_fp32 rebuilds ZeRO-3 weights only for tp 1; the universal conversion handles tp > 1
        return "a ZeRO-3 checkpoint saved with tensor parallelism"
    return None


def saved_lora(ckpt: Path) -> LoRAArgs:
    """The LoRA adapters the checkpoint holds, as trained (``lora_r`` 0: none), whatever the config says: the
    adapters are applied with the checkpoint's rank, scale and targets, as the HF export applies them. A run
    with lora_r set that started from a checkpoint without adapters (its frozen base) saved lora_r > 0."""
    return LoRAArgs.of_record(read_meta(ckpt).get("args") or {})


def lora_differences(config: LoRAArgs, saved: LoRAArgs) -> list[str]:
    """``key: config value -> checkpoint value`` for every LoRA key the config sets otherwise (a user reading the
    log learns that the checkpoint's settings were used)."""
    if not config.lora_enabled and not saved.lora_enabled:
        return []
    mine, theirs = config.settings(), saved.settings()
    return [f"{key} {mine[key]!r} -> {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


def run_name_of(ckpt: Path) -> str | None:
    """The training run that wrote the checkpoint at `ckpt` (``TrainState.run_name``, saved with it)."""
    state = (read_meta(ckpt).get("extra") or {}).get("train_state") or {}
    name = state.get("run_name")
    return str(name) if name else None


def fit_vocabulary(config: GPTConfig, weights: Weights, rows: int) -> Weights:
    """The padded-vocabulary weights trimmed or zero-padded to `rows` (a run at another tp pads the tokenizer's
    vocabulary to another multiple); the rows dropped or added are padding, never real tokens."""
    fitted = dict(weights)
    for name, tensor in weights.items():
        partition = tp_partition_of(config, name)
        if partition is None or not partition.vocabulary or tensor.shape[0] == rows:
            continue
        have = tensor.shape[0]
        fitted[name] = tensor[:rows] if have > rows else torch.nn.functional.pad(tensor, (0, 0, 0, rows - have))
    return fitted


def load_full_weights(module: nn.Module, config: GPTConfig, weights: Weights, *, tp: int, tp_rank: int,
                      pipelined: bool, source: Path) -> None:
    """Every tensor of `module` (a `GPTModel` or this rank's `PipelineModule` stage, tied copies included) from
    the full `weights` under `GPTModel` names: this tp rank's shard of each partitioned one."""
    state, problems = local_weights(module, config, weights, tp=tp, tp_rank=tp_rank, pipelined=pipelined)
    if problems:
        raise CheckpointError(f"{source} does not fit the config's model (its architecture differs from the "
                              "checkpoint's):\n  " + "\n  ".join(problems[:20]))
    with torch.no_grad():
        module.load_state_dict(state, strict=False)  # only computed buffers (rotary) are left out


def read_weights(ckpt: Path, config: GPTConfig) -> tuple[Weights, int]:
    """The full weights of the committed checkpoint `ckpt`, fitted to `config`'s padded vocabulary, and its
    iteration."""
    full = read_full_checkpoint(ckpt)
    return fit_vocabulary(full.config, full.weights, config.vocab), full.iteration


def load_committed_weights(engine: Any, ckpt: Path, args_dict: dict[str, Any], script: str) -> int:
    """The engine path: load the model weights of the committed checkpoint `ckpt` into `engine` on every
    rank through the checkpoint loader; returns the checkpoint's iteration."""
    result = load_checkpoint(engine, ckpt, args_dict, LoadOptions(weights_only=True))
    for note in result.notes:
        log.info("checkpoint: %s", note)
    step = step_of(ckpt.name)
    log.info("%s: weights of %s (iteration %s), through the training engine", script, ckpt, step)
    return int(step or 0)
