"""Layout-independent weight initialisation.

Every full (unsharded) weight is drawn from its own generator seeded by
`(seed, parameter name)`, then this rank keeps its tensor-parallel shard. The name is the
parameter's canonical name in `GPTModel` (e.g. `layers.3.attention.query_key_value.weight`),
passed down by the model, not the name a wrapper happens to give it. So tp=1, tp=2 and any
pipeline split start from the same full weights, which the parity tests rely on.

A shard is described by `partition_dim` and `sections`: the full tensor is a concatenation of
`sections` along `partition_dim` (e.g. fused [q; k; v] or [gate; up]); each section is split into
tp equal chunks and rank r keeps chunk r of every section, in order. This matches how the
forward splits fused projections.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

InitFn = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a (full, fp32, CPU) tensor in place from the given generator."""


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, name) with a hash that is stable across processes."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


# --- init methods (GPT-NeoX names) -----------------------------------------------------------
def _normal(std: float) -> InitFn:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        torch.nn.init.normal_(t, mean=0.0, std=std, generator=gen)

    return init


def _orthogonal(gain: float) -> InitFn:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        torch.nn.init.orthogonal_(t, gain=gain, generator=gen)

    return init


def _xavier_uniform(t: torch.Tensor, gen: torch.Generator) -> None:
    torch.nn.init.xavier_uniform_(t, generator=gen)


def _xavier_normal(t: torch.Tensor, gen: torch.Generator) -> None:
    torch.nn.init.xavier_normal_(t, generator=gen)


def init_method_from_name(name: str, std: float, num_layers: int, hidden_size: int) -> InitFn:
    """The init function for a GPT-NeoX `init_method` / `output_layer_init_method` string."""
    builders: dict[str, Callable[[], InitFn]] = {
        "normal": lambda: _normal(std),
        # residual-output layers: variance shrinks with depth so the residual stream stays O(1)
        "scaled_normal": lambda: _normal(std / math.sqrt(2.0 * num_layers)),
        # one residual branch per layer (e.g. a parallel residual): scale by the layer count only
        "single_residual_scaled_normal": lambda: _normal(std / math.sqrt(num_layers)),
        # GPT-NeoX's orthogonal_init_method: gain sqrt(2 / n_layers), n_layers = 1 unscaled (its
        # get_init_methods passes the arguments of "orthogonal" in the wrong order and raises; the
        # function's own default is what the name means) and num_layers scaled
        "orthogonal": lambda: _orthogonal(math.sqrt(2.0)),
        "scaled_orthogonal": lambda: _orthogonal(math.sqrt(2.0 / num_layers)),
        "xavier_uniform": lambda: _xavier_uniform,
        "xavier_normal": lambda: _xavier_normal,
        "wang_init": lambda: _normal(2.0 / num_layers / math.sqrt(hidden_size)),
        "small_init": lambda: _normal(math.sqrt(2.0 / (5.0 * hidden_size))),
    }
    if name not in builders:
        raise ValueError(f"unknown init method {name!r}; choose one of {sorted(builders)}")
    return builders[name]()


# --- sharding --------------------------------------------------------------------------------
def shard_tensor(
    full: torch.Tensor, dim: int, rank: int, world: int, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's part of `full`: chunk `rank` of each section along `dim`, concatenated."""
    if world == 1:
        return full
    sections = list(sections) if sections is not None else [full.shape[dim]]
    if sum(sections) != full.shape[dim]:
        raise ValueError(f"sections {sections} do not add up to dim {dim} of shape {tuple(full.shape)}")
    parts = []
    for section in full.split(sections, dim=dim):
        if section.shape[dim] % world != 0:
            raise ValueError(f"a section of size {section.shape[dim]} is not divisible by tp={world}")
        parts.append(section.chunk(world, dim=dim)[rank])
    return torch.cat(parts, dim=dim).contiguous()


def unshard_tensors(
    shards: Sequence[torch.Tensor], dim: int, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from every rank's shard, in rank order."""
    world = len(shards)
    if world == 1:
        return shards[0]
    full_len = shards[0].shape[dim] * world
    sections = list(sections) if sections is not None else [full_len]
    local = [s // world for s in sections]
    per_rank = [shard.split(local, dim=dim) for shard in shards]
    return torch.cat([per_rank[r][i] for i in range(len(sections)) for r in range(world)], dim=dim)


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int = -1, sections: Sequence[int] | None = None
) -> None:
    """Mark a parameter the way DeepSpeed looks for it (`deepspeed.runtime.utils.is_model_parallel_parameter`).

    Partitioned parameters count once per tp rank in the gradient norm; replicated ones only on
    tp rank 0. `partition_sections` records the fused layout for checkpoint resharding.
    """
    # attributes a torch.Tensor does not declare (DeepSpeed reads them by name): attr-defined on purpose
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = len(sections) if sections else 1  # type: ignore[attr-defined]
    param.partition_sections = list(sections) if sections else None  # type: ignore[attr-defined]


def tensor_parallel_partition(param: torch.Tensor) -> tuple[int, list[int] | None]:
    """(dim, sections) that :func:`set_tensor_model_parallel_attributes` recorded on ``param``."""
    return int(getattr(param, "partition_dim", -1)), getattr(param, "partition_sections", None)


@torch.no_grad()
def initialize_param_(
    param: torch.Tensor,
    name: str,
    seed: int,
    init_fn: InitFn,
    full_shape: Sequence[int],
    partition_dim: int | None = None,
    rank: int = 0,
    world: int = 1,
    sections: Sequence[int] | None = None,
) -> None:
    """Fill `param` with this rank's shard of the full weight drawn from (seed, name).

    The full weight is drawn on the CPU in fp32 whatever `param`'s device and dtype (the same numbers
    wherever the model is built), and only this rank's shard is copied into `param`: the host holds
    one full weight at a time, never the model.

    A parameter on the ``meta`` device holds no values (the rehearsal builds every rank's part of a large
    model that way, megatron/app/rehearsal.py): its shard is cut from a meta tensor of the full shape, so
    the shapes are checked as ever, and nothing is drawn."""
    drawn = not param.is_meta
    full = torch.empty(tuple(full_shape), dtype=torch.float32, device="cpu" if drawn else "meta")
    if drawn:
        init_fn(full, param_generator(seed, name))
    local = full if partition_dim is None else shard_tensor(full, partition_dim, rank, world, sections)
    if tuple(local.shape) != tuple(param.shape):
        raise ValueError(f"{name}: shard shape {tuple(local.shape)} != parameter shape {tuple(param.shape)}")
    if drawn:
        param.copy_(local.to(dtype=param.dtype, device=param.device))
