"""What ``sharding_strategy: hsdp`` (hybrid sharding, ``megatron/mpu/hybrid_shard.py``) can run with.

Checked before launch by ``derived.derive_sharding``; every refusal names the key and where it was set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.config_rules import RuleContext


def shard_size(ctx: RuleContext, one_node: bool) -> int | None:
    """``sharding_group_size``, or the data-parallel ranks of one node: ``num_gpus`` ranks per node
    (ZeRO-3 goes without tensor and pipeline parallelism, so each of them is a data-parallel rank),
    or every rank when the launch is ``one_node``; None when neither tells the node size."""
    given = ctx.get("sharding_group_size") or ctx.get("num_gpus")
    if given is not None:
        return int(given)
    return ctx.world_size if one_node else None


def _offloaded(block: Any) -> bool:
    return isinstance(block, Mapping) and str(block.get("device", "none")).lower() not in ("none", "")


def hybrid_shard_problems(ctx: RuleContext, zero_block: Mapping[str, Any], one_node: bool) -> list[str]:
    """Combinations hybrid sharding does not support, each with what to do instead."""
    shown = ctx.show("sharding_strategy")
    problems: list[str] = []
    shard, dp = shard_size(ctx, one_node), ctx.dp
    where = ctx.show("sharding_group_size") if ctx.given("sharding_group_size") else (
        f"sharding_group_size={shard} (the ranks per node, num_gpus)")
    if shard is None:
        problems.append(f"{shown} on several nodes without num_gpus: set sharding_group_size (the data-parallel "
                        "ranks of one node, which share each ZeRO-3 partition) or num_gpus")
    elif dp is not None and dp % shard:
        problems.append(f"{shown}: {where} does not divide the data-parallel size {dp}; each replica is "
                        f"sharding_group_size ranks, so set it to a divisor of {dp}")
    if int(zero_block.get("zero_hpz_partition_size") or 1) > 1:
        problems.append(f"{shown} with zero_optimization.zero_hpz_partition_size="
                        f"{zero_block['zero_hpz_partition_size']} ({ctx.source('zero_optimization')}): hsdp is "
                        "Deepy's hybrid sharding (ZeRO-3 within sharding_group_size ranks), not ZeRO++ hpZ; "
                        "remove zero_hpz_partition_size (or use sharding_strategy: fsdp with it)")
    if any(_offloaded(zero_block.get(key)) for key in ("offload_optimizer", "offload_param")) \
            or zero_block.get("cpu_offload"):
        # with offload, ZeRO-3 copies each gradient partition to the CPU during the backward pass,
        # before the replicas' average at the step could reach it
        problems.append(f"{shown} with ZeRO offload (zero_optimization.offload_optimizer/offload_param, "
                        f"{ctx.source('zero_optimization')}) is not supported: the replicas average "
                        "gradients after the copy to the CPU is made; use sharding_strategy: fsdp with offload")
    if ctx.uses_pipeline_module:
        problems.append(f"{shown} with {ctx.show('pipe_parallel_size')}: ZeRO-3 does not run under DeepSpeed's "
                        "PipelineEngine; set pipe_parallel_size: 0")
    if ctx.cp > 1:
        problems.append(f"{shown} with {ctx.show('context_parallel_size')} is not supported: the context-parallel "
                        "ranks would have to sit inside one shard group; use sharding_strategy: fsdp")
    if int(ctx.get("moe_num_experts") or 1) > 1:
        problems.append(f"{shown} with {ctx.show('moe_num_experts')} is not supported: Deepy's expert gradients "
                        "are reduced over the whole data-parallel group; use sharding_strategy: fsdp")
    return problems
