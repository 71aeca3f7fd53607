"""The engine side of hybrid sharding (``sharding_strategy: hsdp``; groups in ``megatron/mpu/hybrid_shard.py``).

DeepSpeed runs plain ZeRO-3 over the shard group it is shown (:class:`ShardGroupView`). Three things
make the replicas one data-parallel run:

* the batch: DeepSpeed counts ``shard`` data-parallel ranks, so its ``train_batch_size`` is Deepy's
  divided by the replicas (:func:`deepspeed_config`);
* the gradients: ZeRO-3 reduce-scatters and averages them within the shard group; the partitions are
  then averaged over the replica group right before the optimizer step (:func:`install`), so every
  replica steps with the mean over all ``dp`` ranks, and sees the same norm and overflow;
* checkpoints: the replicas hold identical partitions under identical file names, so only replica 0
  writes them and every replica reads them back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.deepspeed_internals import reduce_zero3_gradients_before_step, skip_checkpoint_writes
from megatron.mpu import hybrid_shard


def deepspeed_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """``ds_config`` as DeepSpeed must see it when its data-parallel group is one replica's shard group."""
    replicas = hybrid_shard.get_replica_world_size()
    if replicas == 1 or "train_batch_size" not in ds_config:
        return ds_config
    return {**ds_config, "train_batch_size": int(ds_config["train_batch_size"]) // replicas}


def average_over_replicas(buffer: torch.Tensor) -> None:
    """In place: the mean of ``buffer`` over the replica group."""
    dist.all_reduce(buffer, group=hybrid_shard.get_replica_group())
    buffer.div_(hybrid_shard.get_replica_world_size())


def install(engine: Any) -> None:
    """Average gradient partitions over the replicas; only replica 0 writes checkpoint partitions."""
    if hybrid_shard.get_replica_world_size() == 1:
        return
    reduce_zero3_gradients_before_step(engine.optimizer, average_over_replicas)
    if hybrid_shard.get_replica_rank() != 0:
        skip_checkpoint_writes(engine)
