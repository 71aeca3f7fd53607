"""This rank's part of a model's full weights: what a module built for the run's layout loads.

Readers of a checkpoint saved at any layout (a GPT-NeoX checkpoint in ``neox/load.py``, a Deepy one read
whole by ``interop.deepy_checkpoint.read_full_checkpoint`` for generation, the frozen weights a universal
conversion carries in ``reshard.py``) produce full tensors under ``GPTModel`` names: :func:`merge_tp_shards`
glues every tp rank's shard with the architecture a checkpoint recorded (:func:`stored_model_config`), and
:func:`local_weights` cuts them for a plain ``GPTModel`` or this rank's ``PipelineModule`` stage (tied copies
included) at this rank's tensor-parallel place, and names every tensor that does not fit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.errors import CheckpointError
from megatron.model.config import GPTConfig
from megatron.model.partitioning import tp_partition_of
from megatron.model.pipeline import model_parameter_name
from megatron.mpu.initialize_weights import shard_tensor, unshard_tensors
from megatron.objective_needs import known_needs


def stored_model_config(args: dict[str, Any]) -> GPTConfig:
    """The architecture stored with a checkpoint (its resolved arguments), in fp32.

    The model's keys (``GPTConfig``'s fields), taken by name from the stored dict; unset (None) values
    keep the defaults. A reward model's objective gives it its value head.
    """
    values = {key: args[key] for key in GPTConfig.model_fields if key != "precision" and args.get(key) is not None}
    if values.get("padded_vocab_size") is None:
        raise CheckpointError("the checkpoint's arguments have no padded_vocab_size")
    needs = known_needs(str(args.get("train_impl") or "normal"))
    value_head = needs is not None and needs.value_head
    return GPTConfig(**values).replace(value_head=value_head)  # precision unset: fp32


def merge_tp_shards(config: GPTConfig, shards: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from every tp rank's shard (replicated ones: rank 0's copy)."""
    full: dict[str, torch.Tensor] = {}
    for name, parts in shards.items():
        partition = tp_partition_of(config, name)
        if partition is None or len(parts) == 1:
            full[name] = parts[0]
        else:
            full[name] = unshard_tensors(parts, partition.dim, partition.sections)
    return full


def computed_buffer(name: str) -> bool:
    """A rotary buffer: computed from the config, so a checkpoint need not hold it."""
    return name.endswith(".inv_freq")


def local_weights(module: nn.Module, config: GPTConfig, full: dict[str, torch.Tensor], *, tp: int, tp_rank: int,
                  pipelined: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(state dict for ``module`` in its own dtypes, problems). A problem is a tensor of the module missing from
    ``full``, one whose full shape differs, or (plain model only: a stage holds some layers) a tensor of
    ``full`` the module has not."""
    current = module.state_dict()
    # ZeRO-3 leaves each parameter an empty placeholder outside a gather; its whole shape is DeepSpeed's ds_shape
    whole = {name: p.ds_shape for name, p in module.named_parameters(remove_duplicate=False) if hasattr(p, "ds_shape")}
    state: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for local_name, tensor in current.items():
        name = model_parameter_name(local_name) if pipelined else local_name
        if name not in full:
            if not computed_buffer(name):
                problems.append(f"{name}: not in the checkpoint")
            continue
        source = full[name]
        partition = tp_partition_of(config, name)
        want = list(whole.get(local_name, tensor.shape))
        if partition is not None:
            want[partition.dim] *= tp
        if list(source.shape) != want:
            problems.append(f"{name}: checkpoint {tuple(source.shape)}, this config {tuple(want)}")
            continue
        if partition is not None:
            source = shard_tensor(source, partition.dim, tp_rank, tp, partition.sections)
        state[local_name] = source.to(dtype=tensor.dtype)
    if not pipelined:
        problems += [f"{name}: in the checkpoint, not in this model" for name in sorted(full)
                     if name not in current and not computed_buffer(name)]
    return state, problems
