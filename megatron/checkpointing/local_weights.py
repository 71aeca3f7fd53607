"""This rank's part of a model's full weights: what a module built for the run's layout loads.

Readers of a checkpoint saved at any layout (a GPT-NeoX checkpoint in ``neox_import.py``, a Deepy one read
whole by ``interop.deepy_checkpoint.read_full_checkpoint`` for generation) produce full tensors under
``GPTModel`` names; :func:`local_weights` cuts them for a plain ``GPTModel`` or this rank's ``PipelineModule``
stage (tied copies included) at this rank's tensor-parallel place, and names every tensor that does not fit.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.config import GPTConfig
from megatron.model.partitioning import tp_partition_of
from megatron.model.pipeline import model_parameter_name
from megatron.mpu.initialize_weights import shard_tensor


def _computed(name: str) -> bool:
    """A rotary buffer: computed from the config, so a checkpoint need not hold it."""
    return name.endswith(".inv_freq")


def local_weights(module: nn.Module, config: GPTConfig, full: dict[str, torch.Tensor], *, tp: int, tp_rank: int,
                  pipelined: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(state dict for ``module`` in its own dtypes, problems). A problem is a tensor of the module missing from
    ``full``, one whose full shape differs, or (plain model only: a stage holds some layers) a tensor of
    ``full`` the module has not."""
    current = module.state_dict()
    state: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for local_name, tensor in current.items():
        name = model_parameter_name(local_name) if pipelined else local_name
        if name not in full:
            if not _computed(name):
                problems.append(f"{name}: not in the checkpoint")
            continue
        source = full[name]
        partition = tp_partition_of(config, name)
        want = list(tensor.shape)
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
                     if name not in current and not _computed(name)]
    return state, problems
