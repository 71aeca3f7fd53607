"""Full (unsharded) weights of a Deepy checkpoint at any layout, and weights-only checkpoints at a chosen one.

Reading: the model files DeepSpeed wrote for each tensor-parallel rank are merged with the model's
own partition patterns (``megatron.model.partitioning``), the inverse of the sharding every run
starts from (``mpu.initialize_weights.shard_tensor``):

* the model files are in GPT-NeoX's layout (or Deepy's earlier one), translated back to ``GPTModel``
  names and Deepy's QKV order by ``checkpointing.neox.files`` (see ``checkpointing/neox/layout.py``);
* ZeRO-3 (tp = 1): the module files hold placeholders; DeepSpeed's ``zero_to_fp32`` rebuilds the weights
  from the optimizer shards.

Writing: the same files (GPT-NeoX's layout) for a chosen tp/pp, module weights only (no optimizer or RNG files),
plus ``deepy_meta.json`` marked ``weights_only``, ``configs/resolved.yml`` and the ``args`` GPT-NeoX reads
(``checkpointing/neox/record.py``) and the commit marker. DeepSpeed's module-only
load (fine-tuning) reads exactly these files: the first run after a conversion starts its optimizer
fresh. DeepSpeed has no offline writer for its checkpoint layout, hence the few lines that
produce it here; ``tests/e2e/test_hf_interop.py`` loads them through a real DeepSpeed engine.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from megatron.checkpointing import commit
from megatron.checkpointing.local_weights import merge_tp_shards
from megatron.checkpointing.local_weights import stored_model_config as gpt_config_from_args
from megatron.checkpointing.neox import (
    NeoxNames,
    canonical_rank_weights,
    layer_to_neox,
    neox_checkpoint_args,
    plain_to_neox,
)
from megatron.checkpointing.neox import config_files as neox_config_files
from megatron.checkpointing.safe_load import weights_only_loading
from megatron.checkpointing.save_load import (
    CLIENT_KEY,
    CONFIGS_DIR,
    FORMAT_VERSION,
    META_FILE,
    WEIGHTS_ONLY_KEY,
    read_meta,
)
from megatron.checkpointing.universal import Layout
from megatron.errors import CheckpointError, ConversionError
from megatron.model.config import GPTConfig
from megatron.model.partitioning import tp_partition_of
from megatron.model.pipeline import pipeline_location
from megatron.mpu.initialize_weights import shard_tensor

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FullCheckpoint:
    path: Path
    config: GPTConfig
    weights: Weights
    iteration: int
    args: dict[str, Any]
    """The arguments stored with the checkpoint (tokenizer, precision, ...)."""


# --- which checkpoint --------------------------------------------------------------------------
def resolve_checkpoint(path: Path, iteration: int | None = None) -> Path:
    """A tag directory as given, or the newest (or ``iteration``'s) committed checkpoint of a save directory."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / META_FILE).is_file():
        if not commit.is_committed(path):
            raise CheckpointError(f"{path} is an incomplete checkpoint (no {commit.COMMIT_MARKER} marker): its save "
                                  "was interrupted; convert a committed one")
        return path
    if iteration is not None:
        tag = commit.tag_for(iteration)
        if not commit.is_committed(path / tag):
            steps = ", ".join(map(str, commit.list_checkpoints(path).steps)) or "none"
            raise CheckpointError(f"{path} has no committed checkpoint for iteration {iteration}; committed: {steps}")
        return path / tag
    newest, _ = commit.newest_committed(path)
    if newest is None:
        raise CheckpointError(f"{path} holds no committed Deepy checkpoint")
    return path / newest


# --- reading ---------------------------------------------------------------------------------
def _rank_shards(ckpt: Path, layout: Layout, config: GPTConfig) -> dict[str, list[torch.Tensor]]:
    """Every tp rank's tensors under ``GPTModel`` names, from GPT-NeoX's layout or Deepy's earlier one."""
    names = NeoxNames.from_config(config)
    shards: dict[str, list[torch.Tensor]] = defaultdict(list)
    for tp_rank in range(layout.tp):
        for name, tensor in canonical_rank_weights(ckpt, names, layout.tp, tp_rank, layout.pipeline).items():
            shards[name].append(tensor)
    return shards


def _zero3_weights(ckpt: Path, layout: Layout) -> Weights:
    if layout.tp != 1:
        raise ConversionError(f"{ckpt}: reading a ZeRO-3 checkpoint saved with tensor parallelism (tp={layout.tp}) "
                              "is not supported; resume it at ZeRO stage 1 or 2 and save again")

    with weights_only_loading(ckpt):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    return dict(state)


def read_checkpoint_config(ckpt: Path) -> tuple[GPTConfig, dict[str, Any]]:
    """Architecture and stored arguments of a committed checkpoint (tag) directory, without its tensors."""
    args = dict(read_meta(ckpt).get("args") or {})
    return gpt_config_from_args(args), args


def read_full_checkpoint(path: Path, iteration: int | None = None) -> FullCheckpoint:
    """The full weights of a committed Deepy checkpoint (a save directory or one tag directory)."""
    ckpt = resolve_checkpoint(path, iteration)
    meta = read_meta(ckpt)
    layout = Layout.from_dict(meta["layout"])
    config, args = read_checkpoint_config(ckpt)
    if layout.zero_stage == 3 and not meta.get(WEIGHTS_ONLY_KEY):
        weights = _zero3_weights(ckpt, layout)
    else:
        shards = _rank_shards(ckpt, layout, config)
        weights = merge_tp_shards(config, shards)
    return FullCheckpoint(path=ckpt, config=config, weights=weights, iteration=int(meta["iteration"]), args=args)


# --- writing ---------------------------------------------------------------------------------
def shard_for_tp(config: GPTConfig, weights: Weights, tp: int) -> list[Weights]:
    """Each tp rank's part of every weight (replicated weights whole on every rank)."""
    config.check_tensor_parallel(tp)
    ranks: list[Weights] = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        partition = tp_partition_of(config, name)
        for rank in range(tp):
            if partition is None:
                ranks[rank][name] = tensor
            else:
                ranks[rank][name] = shard_tensor(tensor, partition.dim, rank, tp, partition.sections).clone()
    return ranks


def _engine_state(module: Weights | None, step: int, consumed_samples: int, mp_world_size: int,
                  args: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed's module-only load reads from ``mp_rank_XX_model_states.pt`` (0.19.8), with the
    client state GPT-NeoX reads (``iteration``, ``args``) and Deepy's format (which says the QKV order)."""
    return {
        "module": module, "buffer_names": [], "optimizer": None, "param_shapes": None,
        "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
        "global_steps": step, "global_samples": consumed_samples, "dp_world_size": 1,
        "mp_world_size": mp_world_size, "ds_config": {}, "ds_version": deepspeed.__version__,
        "iteration": step, "args": neox_checkpoint_args(args),  # GPT-NeoX's client state
        CLIENT_KEY: {"format": FORMAT_VERSION, "iteration": step, "consumed_samples": consumed_samples},
    }  # fmt: skip


def write_weights_only_checkpoint(
    save_dir: Path,
    *,
    config: GPTConfig,
    weights: Weights,
    tp: int,
    pp: int,
    step: int = 0,
    consumed_samples: int = 0,
    args: dict[str, Any],
    source: str = "",
) -> Path:
    """A committed Deepy checkpoint ``<save_dir>/global_step<step>`` of ``weights`` at tp/pp
    (``pp = 0``: the plain model; ``pp >= 1``: pipeline layers, which load at any pp)."""
    if tp < 1 or pp < 0:
        raise ConversionError(f"--tp must be >= 1 and --pp >= 0 (got tp={tp}, pp={pp})")
    if pp > config.arch.layers:
        raise ConversionError(f"--pp {pp} exceeds num_layers={config.num_layers}")
    ckpt = save_dir / commit.tag_for(step)
    if ckpt.exists():
        raise ConversionError(f"{ckpt} already exists; choose an empty --output directory")
    ckpt.mkdir(parents=True)
    per_rank = shard_for_tp(config, weights, tp)
    stages = max(pp, 1)
    names = NeoxNames.from_config(config)  # written in GPT-NeoX's layout, as training runs save
    if pp == 0:
        for rank, module in enumerate(per_rank):
            state = _engine_state(plain_to_neox(names, module, tp), step, consumed_samples, tp, args)
            torch.save(state, ckpt / f"mp_rank_{rank:02d}_model_states.pt")
    else:
        for rank, module in enumerate(per_rank):
            layers: dict[int, Weights] = defaultdict(dict)
            for name, tensor in module.items():
                try:
                    index, local = pipeline_location(name, config.arch.layers)
                except ValueError as err:
                    raise ConversionError(str(err)) from err
                layers[index][local] = tensor
            for spec, state in sorted(layers.items()):
                index = names.neox_index(spec)
                neox = {n: t.contiguous().clone() for n, t in layer_to_neox(names, spec, state, tp).items()}
                torch.save(neox, ckpt / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
        # DeepSpeed numbers a pipeline's model-parallel files stage-major: stage * tp + tp rank
        for mp_rank in range(stages * tp):
            state = _engine_state(None, step, consumed_samples, stages * tp, args)
            torch.save(state, ckpt / f"mp_rank_{mp_rank:02d}_model_states.pt")
    layout = Layout(tp=tp, pp=stages, dp=1, zero_stage=0, pipeline=pp >= 1)
    meta = {
        "format": FORMAT_VERSION, "iteration": step, "consumed_samples": consumed_samples, "kind": "permanent",
        "layout": layout.to_dict(), "world_size": tp * stages, "extra": {}, "universal_info": None,
        "args": args, WEIGHTS_ONLY_KEY: True, "converted_from": source,
    }  # fmt: skip
    (ckpt / META_FILE).write_text(json.dumps(meta, indent=1, default=str), encoding="utf-8")
    (ckpt / CONFIGS_DIR).mkdir()
    resolved = {"pipe_parallel_size": pp, "model_parallel_size": tp, "num_layers": config.num_layers, **args}
    for name, text in neox_config_files(resolved).items():
        (ckpt / CONFIGS_DIR / name).write_text(text, encoding="utf-8")
    commit.write_commit_marker(ckpt, commit.CommitInfo(step=step, kind="permanent", time=time.time()))
    commit.write_latest(save_dir, ckpt.name)
    return ckpt
