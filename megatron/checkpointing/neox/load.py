"""``load`` on a checkpoint GPT-NeoX wrote: its weights go straight into this run's engine.

A GPT-NeoX checkpoint (``<load>/global_stepN`` or the tag ``0`` that GPT-NeoX's Llama converter
writes, with ``latest`` naming it) has DeepSpeed model files and no ``deepy_meta.json``. It may have
no ``configs/`` either, so the architecture is the one of this run's config; the ``args`` GPT-NeoX
records in ``mp_rank_00_model_states.pt`` must agree with it, and a tensor whose shape does not fit
is reported by name, before any weight changes. Its files name the MLP weights in either of
GPT-NeoX's eras, but cannot say the order of grouped-query QKV rows: ``neox_qkv_order`` does.

Every rank reads the model files of every tensor-parallel rank (a GPT-NeoX checkpoint may have been
saved at another tp/pp), joins them into full tensors and keeps its own part; under ZeRO-3 that part
is copied into the partitioned module one module at a time and DeepSpeed's fp32 partitions follow
(``partitioned_load.py``). The optimizer starts fresh: GPT-NeoX's optimizer files belong to
DeeperSpeed's layout. Resuming keeps GPT-NeoX's iteration and consumed samples; ``finetune`` /
``initialize_from`` start at step 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron.checkpointing.local_weights import local_weights, merge_tp_shards, stored_model_config
from megatron.checkpointing.neox.files import gqa_order_for, load_model_file as _load, neox_checkpoint_shards
from megatron.checkpointing.neox.layout import GqaOrder, NeoxNames
from megatron.checkpointing.partitioned_load import load_into_partitioned
from megatron.errors import CheckpointError
from megatron.mpu import topology

_MP_FILE = "mp_rank_00_model_states.pt"


def neox_position(tag: Path, args: dict[str, Any]) -> tuple[int, int]:
    """(iteration, consumed samples) recorded by GPT-NeoX in ``mp_rank_00_model_states.pt``."""
    state = _load(tag / _MP_FILE) if (tag / _MP_FILE).is_file() else {}
    iteration = int(state.get("iteration") or state.get("global_steps") or 0)
    consumed = state.get("global_samples")
    if consumed is None:
        consumed = iteration * int(args.get("train_batch_size") or 0)
    return iteration, int(consumed)


_RECORDED_SHAPE = ("num_layers", "hidden_size", "num_attention_heads")
"""Keys of GPT-NeoX's recorded ``args`` that must equal this run's (tp and the tokenizer may change;
the padded vocabulary is checked as the embedding's rows)."""


def recorded_mismatches(tag: Path, args: dict[str, Any]) -> list[str]:
    """Where the ``args`` GPT-NeoX recorded in ``tag`` disagree with this run (same-shape tensors can
    hide some: a different head count splits the same QKV weight into other heads)."""
    state = _load(tag / _MP_FILE) if (tag / _MP_FILE).is_file() else {}
    recorded = state.get("args") if isinstance(state, dict) else None
    if not isinstance(recorded, dict):
        return []
    return [f"{key}: checkpoint {recorded[key]!r}, config {args.get(key)!r}"
            for key in _RECORDED_SHAPE if recorded.get(key) is not None and recorded[key] != args.get(key)]


def load_neox_weights(engine: Any, tag: Path, args: dict[str, Any], qkv_order: GqaOrder | None = None) -> list[str]:
    """Copy the weights of GPT-NeoX checkpoint ``tag`` into ``engine``'s module (this rank's part).
    Returns notes for the log."""
    mismatched = recorded_mismatches(tag, args)
    if mismatched:
        raise CheckpointError(f"the GPT-NeoX checkpoint {tag} was saved for another model (its recorded args):\n  "
                              + "\n  ".join(mismatched))
    config = stored_model_config(args)
    names = gqa_order_for(NeoxNames.from_config(config), None, qkv_order, tag)
    shards, source_tp = neox_checkpoint_shards(tag, names)
    full = merge_tp_shards(config, shards)
    pipeline = isinstance(engine, PipelineEngine)
    new_state, problems = local_weights(engine.module, config, full, tp=topology.get_tensor_model_parallel_world_size(),
                                        tp_rank=topology.get_tensor_model_parallel_rank(), pipelined=pipeline)
    if problems:
        raise CheckpointError(
            f"the GPT-NeoX checkpoint {tag} does not fit this run's model (num_layers, hidden_size, "
            "num_attention_heads, num_kv_heads, intermediate_size, norm, activation, no_weight_tying and the "
            "vocabulary decide the shapes):\n  " + "\n  ".join(problems[:20])
        )
    if int(engine.zero_optimization_stage()) == 3:  # the module is partitioned: gathered one module at a time
        load_into_partitioned(new_state, engine.module, strict=False)  # computed buffers are not in new_state
    else:
        with torch.no_grad():
            engine.module.load_state_dict(new_state, strict=False)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()  # ZeRO / fp16 / bf16 optimizers keep their own fp32 copy of the weights
    return [f"loaded the GPT-NeoX checkpoint {tag} (saved at tp={source_tp}) into this run's layout; the "
            "optimizer and LR schedule start fresh"]
