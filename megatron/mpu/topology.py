"""Process groups for tensor (tp), pipeline (pp) and data (dp) parallelism.

The rank layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the
model/tensor axis varies fastest), so our groups agree with the grid that DeepSpeed's
``PipelineModule`` builds from the same topology object. Works with any torch.distributed
backend (gloo on CPU, nccl on GPU).

This module is the only holder of parallel state; everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
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
    # tensor x pipeline: every rank holding a different part of one model replica
    model_group: dist.ProcessGroup | None = None
    tp_ranks: list[int] = []
    pp_ranks: list[int] = []
    dp_ranks: list[int] = []


_STATE = _State()


def build_topology(tp: int, pp: int, world_size: int) -> PipeModelDataParallelTopology:
    """The grid for ``world_size`` ranks; ``pp=0`` (no pipeline) counts as one stage."""
    pp = max(pp, 1)
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world_size // (tp * pp))


def initialize_model_parallel(tp: int, pp: int) -> PipeModelDataParallelTopology:
    """Create the tp/pp/dp/model groups. Every rank must call this, in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before the model-parallel groups")
    world = dist.get_world_size()
    rank = dist.get_rank()
    topo = build_topology(tp, pp, world)
    _STATE.topology = topo

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
    _STATE.tp_group = _STATE.pp_group = _STATE.dp_group = _STATE.model_group = None
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


# --- the names DeepSpeed looks for on an ``mpu`` object ------------------------------------------
# DeepSpeed calls these on the module passed as ``deepspeed.initialize(mpu=...)``: the "model
# parallel" group there means the tensor-parallel group (gradient-norm reduction, ZeRO partitioning).
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
