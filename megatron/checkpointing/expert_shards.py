"""Experts split over data-parallel ranks (``moe_expert_parallel_size > 1``) in a checkpoint.

Without ZeRO, DeepSpeed writes the model and optimizer once per (tp, pp) place, from data-parallel
rank 0, and every rank reads that copy back: right for replicas, wrong for experts, which differ
between the ranks of an expert-parallel group. So the first expert-data-parallel replica of each
expert-parallel rank also writes ``deepy_experts/tp<t>_pp<p>_ep<e>.pt``: its expert parameters and
their optimizer moments, by parameter name. Loading (after DeepSpeed's own load) puts them back on
every rank that holds those experts.

Only the same expert-parallel size can be loaded: the shards would need re-splitting, which is not
built (``check_expert_layout`` says so before anything is read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.safe_load import load_trusted_tensors
from megatron.errors import CheckpointError
from megatron.mpu import experts as expert_parallel
from megatron.mpu import topology

EXPERTS_DIR = "deepy_experts"
EP_KEY = "moe_expert_parallel_size"


def _shard_file(ckpt_dir: Path) -> Path:
    name = (f"tp{topology.get_tensor_model_parallel_rank():02d}_pp{topology.get_pipe_parallel_rank():02d}"
            f"_ep{expert_parallel.get_expert_parallel_rank():02d}.pt")  # fmt: skip
    return ckpt_dir / EXPERTS_DIR / name


def _expert_params(engine: Any) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in engine.module.named_parameters() if expert_parallel.is_expert_parallel(p)}


def check_expert_layout(saved_args: dict[str, Any], args: dict[str, Any], ckpt_dir: Path) -> None:
    saved, current = int(saved_args.get(EP_KEY) or 1), int(args.get(EP_KEY) or 1)
    if saved != current:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved with {EP_KEY}={saved}, this run has {current}: re-splitting "
            f"experts over a different number of data-parallel ranks is not supported yet; resume with "
            f"{EP_KEY}: {saved}"
        )


def save_expert_shards(engine: Any, ckpt_dir: Path, save_optim: bool = True) -> None:
    """Write this rank's experts if it is the first replica of its expert-parallel rank (their optimizer moments too
    unless ``save_optim`` is False: ``no_save_optim``)."""
    params = _expert_params(engine)
    if not params or topology.get_data_parallel_rank() >= expert_parallel.get_expert_parallel_world_size():
        return
    state = getattr(engine.optimizer, "state", {}) if save_optim else {}
    shard = {
        "params": {name: p.detach().cpu().clone() for name, p in params.items()},
        "optimizer": {
            name: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state[p].items()}
            for name, p in params.items()
            if p in state
        },
    }
    path = _shard_file(ckpt_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(shard, path)


def load_expert_shards(engine: Any, ckpt_dir: Path, load_optim: bool) -> None:
    """Put this rank's experts (and, with ``load_optim``, their optimizer moments) back."""
    params = _expert_params(engine)
    if not params:
        return
    path = _shard_file(ckpt_dir)
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {path.relative_to(ckpt_dir)}: its experts split over "
                              f"data-parallel ranks were not saved with it")  # fmt: skip
    shard = load_trusted_tensors(path)
    missing = sorted(set(params) - set(shard["params"]))
    if missing:
        raise CheckpointError(f"{path} lacks expert parameters {missing}")
    state = getattr(engine.optimizer, "state", None)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(shard["params"][name])
            saved = shard["optimizer"].get(name)
            if load_optim and state is not None and saved is not None:
                state[param] = {k: (v.to(param.device) if torch.is_tensor(v) else v) for k, v in saved.items()}
