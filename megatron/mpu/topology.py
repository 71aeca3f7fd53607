"""Process groups for tensor (tp), pipeline (pp) and data (dp) parallelism.

The rank layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the
model/tensor axis varies fastest), so our groups agree with the grid that DeepSpeed's
``PipelineModule`` builds from the same topology object. Works with any torch.distributed
backend (gloo on CPU, nccl on GPU).

Context parallelism (cp) splits each sequence over ``cp`` ranks that read the same samples. To
DeepSpeed those ranks are data-parallel ranks (they hold the same weights, and their gradients are
averaged like any other data-parallel rank's), so the topology's data axis has ``dp * cp`` ranks,
context-parallel neighbours adjacent on it: DeepSpeed, ZeRO and the pipeline grid need nothing
new. What differs is which samples a rank reads (:func:`get_data_shard_rank`: the ``cp`` ranks of
a group read the same ones) and the context-parallel group that attention talks over.

This module is the only holder of parallel state; everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import deepspeed.accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the (tp, pp, dp) grid."""

    rank: int
    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"rank={self.rank} tp={self.tp} pp={self.pp} dp={self.dp}"


class _State:
    topology: PipeModelDataParallelTopology | None = None
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp: int = 1
    # tensor x pipeline: every rank holding a different part of one model replica
    model_group: dist.ProcessGroup | None = None
    tp_ranks: list[int] = []
    pp_ranks: list[int] = []
    dp_ranks: list[int] = []


_STATE = _State()


def build_topology(tp: int, pp: int, world_size: int, cp: int = 1) -> PipeModelDataParallelTopology:
    """The grid for ``world_size`` ranks; ``pp=0`` (no pipeline) counts as one stage. Its data axis
    holds the ``dp * cp`` ranks that share weights (see the module docstring)."""
    pp = max(pp, 1)
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world_size // (tp * pp))


def initialize_model_parallel(tp: int, pp: int, cp: int = 1) -> PipeModelDataParallelTopology:
    """Create the tp/pp/dp/cp/model groups. Every rank must call this, in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before the model-parallel groups")
    world = dist.get_world_size()
    rank = dist.get_rank()
    topo = build_topology(tp, pp, world, cp)
    _STATE.topology = topo
    _STATE.cp = cp

    def groups_along(axis: str) -> tuple[dist.ProcessGroup | None, list[int]]:
        mine: tuple[dist.ProcessGroup | None, list[int]] = (None, [])
        for ranks in topo.get_axis_comm_lists(axis):
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine = (group, list(ranks))
        return mine

    _STATE.tp_group, _STATE.tp_ranks = groups_along("model")
    _STATE.pp_group, _STATE.pp_ranks = groups_along("pipe")
    _STATE.dp_group, _STATE.dp_ranks = groups_along("data")
    # context-parallel groups: cp neighbours on the data axis, same stage and tp rank
    for ranks in topo.get_axis_comm_lists("data"):
        for start in range(0, len(ranks), cp):
            members = list(ranks[start : start + cp])
            group = dist.new_group(ranks=members) if cp > 1 else None
            if rank in members:
                _STATE.cp_group = group
    # one model replica = all ranks sharing a data coordinate
    for dp_index in range(topo.get_dim("data")):
        ranks = topo.filter_match(data=dp_index)
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            _STATE.model_group = group
    return topo


def model_parallel_is_initialized() -> bool:
    return _STATE.topology is not None


def destroy_model_parallel() -> None:
    _STATE.topology = None
    _STATE.tp_group = _STATE.pp_group = _STATE.dp_group = _STATE.model_group = _STATE.cp_group = None
    _STATE.cp = 1
    _STATE.tp_ranks, _STATE.pp_ranks, _STATE.dp_ranks = [], [], []


def get_topology() -> PipeModelDataParallelTopology:
    if _STATE.topology is None:
        raise RuntimeError("model parallel groups are not initialized")
    return _STATE.topology


def get_coordinates(rank: int | None = None) -> Coordinates:
    topo = get_topology()
    rank = dist.get_rank() if rank is None else rank
    coord = topo.get_coord(rank)
    return Coordinates(rank=rank, tp=coord.model, pp=coord.pipe, dp=coord.data)


# --- tensor parallel -------------------------------------------------------------------------
def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    return _STATE.tp_group


def get_tensor_model_parallel_world_size() -> int:
    return get_topology().get_dim("model") if _STATE.topology is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return get_coordinates().tp if _STATE.topology is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tp-rank 0 in this rank's tensor-parallel group."""
    return _STATE.tp_ranks[0] if _STATE.tp_ranks else 0


# --- pipeline parallel -----------------------------------------------------------------------
def get_pipe_parallel_group() -> dist.ProcessGroup | None:
    return _STATE.pp_group


def get_pipe_parallel_world_size() -> int:
    return get_topology().get_dim("pipe") if _STATE.topology is not None else 1


def get_pipe_parallel_rank() -> int:
    return get_coordinates().pp if _STATE.topology is not None else 0


# --- data parallel ---------------------------------------------------------------------------
def get_data_parallel_group() -> dist.ProcessGroup | None:
    return _STATE.dp_group


def get_data_parallel_world_size() -> int:
    return get_topology().get_dim("data") if _STATE.topology is not None else 1


def get_data_parallel_rank() -> int:
    return get_coordinates().dp if _STATE.topology is not None else 0


# --- context parallel ----------------------------------------------------------------------------
def get_context_parallel_group() -> dist.ProcessGroup | None:
    return _STATE.cp_group


def get_context_parallel_world_size() -> int:
    return _STATE.cp if _STATE.topology is not None else 1


def get_context_parallel_rank() -> int:
    """This rank's piece of each sequence (0 = the first ``s / cp`` tokens)."""
    return get_data_parallel_rank() % _STATE.cp if _STATE.topology is not None else 0


def get_data_shard_rank() -> int:
    """Which share of the global batch this rank reads: the same for a context-parallel group."""
    return get_data_parallel_rank() // _STATE.cp if _STATE.topology is not None else 0


def get_data_shard_count() -> int:
    """How many shares the global batch is read in (the data-parallel size without context parallelism)."""
    return get_data_parallel_world_size() // _STATE.cp if _STATE.topology is not None else 1


def new_data_shard_group(backend: str = "gloo") -> tuple[dist.ProcessGroup | None, int]:
    """A new ``backend`` group of the ranks of this pipeline stage that read this rank's data shard (its
    tensor- and context-parallel neighbours), with the group's first global rank; ``(None, this rank)``
    when each shard has one rank per stage. One group per shard and stage is made, so every rank must
    call this, in the same order. A group of its own keeps its collectives apart from training's (it
    may be used from the data-prefetching thread)."""
    topo = get_topology()
    rank = dist.get_rank()
    members: dict[tuple[int, int], list[int]] = {}
    for r in range(dist.get_world_size()):
        coord = topo.get_coord(r)
        members.setdefault((coord.pipe, coord.data // _STATE.cp), []).append(r)
    if all(len(ranks) == 1 for ranks in members.values()):
        return None, rank
    mine: tuple[dist.ProcessGroup | None, int] = (None, rank)
    for _, ranks in sorted(members.items()):
        group = dist.new_group(ranks=ranks, backend=backend)
        if rank in ranks:
            mine = (group, ranks[0])
    return mine


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live to take part in a collective over ``group``: NCCL moves GPU memory
    only (a CPU tensor is refused), gloo moves host memory."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device(deepspeed.accelerator.get_accelerator().current_device_name())  # patchable
    return torch.device("cpu")


def rank0_decides(value: bool) -> bool:
    """Global rank 0's ``value``, on every rank (a broadcast every rank enters; ``value`` itself without a process
    group). For a decision read from one rank's own state (a directory on its disk, its clock): the ranks that act
    on it then enter the same collectives, or none of them does."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.broadcast(flag, src=0)
    return bool(flag.item())


# --- the names DeepSpeed looks for on an ``mpu`` object ------------------------------------------
# DeepSpeed calls these on the module passed as ``deepspeed.initialize(mpu=...)``: the "model
# parallel" group there means the tensor-parallel group (gradient-norm reduction, ZeRO partitioning).
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
