"""Hybrid sharding (``sharding_strategy: hsdp``): ZeRO-3 within a shard group, replicas across them.

The data-parallel ranks (the topology's data axis, ``dp`` of them) split into ``dp / shard`` replicas
of ``shard`` consecutive ranks each (consecutive data indices sit on one node, so a shard group is
node-local when ``shard`` is the data-parallel ranks per node):

* a **shard group** (``dp=4, shard=2``: data ranks {0, 1} and {2, 3}) partitions the parameters,
  gradients and optimizer states as ZeRO-3 does, so its all-gathers and reduce-scatters stay in
  the node and each rank holds ``1/shard`` of the model states;
* a **replica group** (data ranks {0, 2} and {1, 3}: the same shard index on every node) holds the
  same partition; its ranks average their partitioned gradients once per step.

DeepSpeed (0.19.8) removed MiCS, its own hybrid scheme, and ZeRO++'s hpZ keeps the optimizer and
the primary parameter shards split over every rank (only a secondary parameter copy is node-local),
so Deepy builds the two group families here and hands DeepSpeed :class:`ShardGroupView`, an ``mpu``
whose data-parallel group is the shard group. Everything else of Deepy (sampler, loss averaging,
logging, checkpoint layout) keeps the full data-parallel group of :mod:`megatron.mpu.topology`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron.mpu import topology


class _HybridState:
    shard: int = 1
    """Data-parallel ranks per shard group (1 = not initialized: no hybrid sharding)."""
    replicas: int = 1
    shard_group: dist.ProcessGroup | None = None
    shard_ranks: list[int] = []
    replica_group: dist.ProcessGroup | None = None
    replica_ranks: list[int] = []


_STATE = _HybridState()


def shard_and_replica_ranks(topo: Any, shard: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) as lists of global ranks, for every (pipe, model) coordinate:
    a pure function of the topology, so tests can check the layout without processes."""
    dp = topo.get_dim("data")
    if shard < 1 or dp % shard:
        raise ValueError(f"sharding_group_size={shard} does not divide the data-parallel size {dp}")
    shards: list[list[int]] = []
    replicas: list[list[int]] = []
    for pipe in range(topo.get_dim("pipe")):
        for model in range(topo.get_dim("model")):
            ranks = [topo.get_rank(pipe=pipe, data=d, model=model) for d in range(dp)]
            shards += [ranks[start:start + shard] for start in range(0, dp, shard)]
            replicas += [ranks[index::shard] for index in range(shard)]
    return shards, replicas


def initialize_hybrid_shard(shard: int | None) -> None:
    """Create the shard and replica groups (``shard``: data-parallel ranks per shard group; None:
    hybrid sharding off). Every rank calls this after ``initialize_model_parallel``, in the same order."""
    destroy_hybrid_shard()
    if shard is None:
        return
    shards, replicas = shard_and_replica_ranks(topology.get_topology(), shard)
    rank = dist.get_rank()
    for members in shards:
        group = dist.new_group(ranks=members)
        if rank in members:
            _STATE.shard_group, _STATE.shard_ranks = group, members
    for members in replicas:
        group = dist.new_group(ranks=members)
        if rank in members:
            _STATE.replica_group, _STATE.replica_ranks = group, members
    _STATE.shard = shard
    _STATE.replicas = len(_STATE.replica_ranks)


def destroy_hybrid_shard() -> None:
    _STATE.shard, _STATE.replicas = 1, 1
    _STATE.shard_group = _STATE.replica_group = None
    _STATE.shard_ranks, _STATE.replica_ranks = [], []


def is_hybrid() -> bool:
    """Whether the shard groups were built (even a single replica counts: DeepSpeed gets the view)."""
    return _STATE.shard_group is not None


def get_shard_group() -> dist.ProcessGroup | None:
    return _STATE.shard_group


def get_shard_world_size() -> int:
    return _STATE.shard if is_hybrid() else topology.get_data_parallel_world_size()


def get_shard_rank() -> int:
    return _STATE.shard_ranks.index(dist.get_rank()) if is_hybrid() else topology.get_data_parallel_rank()


def get_replica_group() -> dist.ProcessGroup | None:
    return _STATE.replica_group


def get_replica_world_size() -> int:
    """How many copies of each ZeRO partition exist (1 without hybrid sharding)."""
    return _STATE.replicas


def get_replica_rank() -> int:
    """Which copy this rank holds: only replica 0 writes the ZeRO partitions of a checkpoint."""
    return _STATE.replica_ranks.index(dist.get_rank()) if is_hybrid() else 0


class ShardGroupView:
    """What DeepSpeed is handed as ``mpu`` under hybrid sharding: :mod:`megatron.mpu` except that the
    data-parallel group, size and rank are the shard group's.

    DeepSpeed takes its ZeRO partition group (``groups._get_sequence_data_parallel_group``), its
    ``dp_world_size`` (batch arithmetic) and ``zero.Init``'s group from these three names; the
    tensor/pipeline names it also calls are passed through unchanged.
    """

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return get_shard_group()

    def get_data_parallel_world_size(self) -> int:
        return get_shard_world_size()

    def get_data_parallel_rank(self) -> int:
        return get_shard_rank()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("get_") or name.startswith("model_parallel"):
            return getattr(topology, name)
        raise AttributeError(name)
