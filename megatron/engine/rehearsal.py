"""Every rank's part of the model at a world size this machine does not have, built by the engine code the ranks run.

``deepy.py --rehearse N`` (megatron/app/rehearsal.py) asks what a launch of ``N`` ranks would hold, without
those ranks. For each distinct (pipeline stage, tensor-parallel rank) this module makes this one process rank
``r`` of ``N`` on torch's fake process-group backend (``torch_internals.fake_process_group``: every collective
returns at once and moves nothing), builds the process groups as a rank does (``mpu.initialize_model_parallel``
and the expert and hybrid-shard groups, as ``megatron/initialize.py`` does), and builds the model as the rank
would: ``engine.build_model`` (DeepSpeed's ``PipelineModule`` on our topology, partitioned by our
``pipe_partition_method``, or the plain ``GPTModel``) with LoRA adapters and activation checkpointing as
configured, on the ``meta`` device (shapes only: no memory, no initialisation drawn). What it built is counted:
its blocks, its parameters, the optimizer's parameter groups (``optimizers.param_groups``) and the frozen rest.

Data-parallel ranks of one (stage, tp rank) build the same module, so one build stands for all of them; the
ZeRO partition each of them owns is arithmetic on these parameters (``zero_shards.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import deepspeed
import torch

from megatron import mpu
from megatron.deepspeed_internals import activation_checkpointing_kept, skip_shared_memory_comm_op
from megatron.logging.console import deepspeed_prints_quiet
from megatron.model.block import Block
from megatron.model.config import GPTConfig
from megatron.model.pipeline import CHECKPOINTABLE_LAYERS
from megatron.mpu.experts import destroy_expert_parallel, initialize_expert_parallel
from megatron.mpu.hybrid_shard import destroy_hybrid_shard, initialize_hybrid_shard
from megatron.mpu.topology import build_topology
from megatron.torch_internals import fake_process_group, meta_tensors_stay_on_meta
from megatron.engine.build import build_model, layers_to_checkpoint
from megatron.objectives import build_objective
from megatron.engine.optimizers import param_groups
from megatron.engine.engine_config import EngineConfig


@dataclass(frozen=True, kw_only=True)
class Partition:
    """What the ranks of one (pipeline stage, tensor-parallel rank) build."""

    stage: int
    tp_rank: int
    rank: int
    """The global rank that built it (data-parallel rank 0 of the pair)."""
    modules: tuple[str, ...]
    """Class names of the stage's layers in order (PipelineModule's ``forward_funcs``; a tied head shows as
    ``tied:<name>``), or ``GPTModel`` without a pipeline."""
    blocks: tuple[int, ...]
    """Layer numbers of the blocks (transformer, Mamba, RWKV, gMLP) it holds."""
    recomputed_blocks: int
    """Blocks whose forward runs again in the backward (activation checkpointing)."""
    recomputed_chunks: int
    """Checkpointed chunks (each saves one input, all-gathered over tp with ``partition_activations``)."""
    groups: tuple[tuple[torch.Tensor, ...], ...]
    """The optimizer's parameter groups (trainable parameters, meta tensors), as ``param_groups`` makes them."""
    params: tuple[torch.Tensor, ...]
    """Every parameter, in the module's order (the optimizer does not see the frozen ones: LoRA's base)."""
    tied_embedding: int
    """Elements of a tied embedding this stage shares with another stage (0: none), whose gradient the two
    stages all-reduce every step."""
    has_embedding: bool
    has_lm_head: bool
    """Computes vocab-parallel logits (an untied output layer or the tied embedding)."""

    @property
    def parameters(self) -> int:
        return sum(t.numel() for t in self.params)

    @property
    def trainable(self) -> int:
        return sum(t.numel() for group in self.groups for t in group)


@contextlib.contextmanager
def fake_rank(rank: int, world: int, run: EngineConfig) -> Iterator[None]:
    """This process as rank ``rank`` of ``world``, with the process groups a rank of ``run`` builds."""
    parallel = run.parallel
    skip_shared_memory_comm_op()  # no compile of DeepSpeed's CPU all-reduce op for a rank that sends nothing
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # PipelineModule reads it to place the stage (which stays on meta)
    try:
        with activation_checkpointing_kept(), fake_process_group(rank, world):
            # DeepSpeed's comm layer (PipelineModule's groups) over the same process group
            deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False, rank=rank, world_size=world)
            mpu.initialize_model_parallel(parallel.model_parallel_size, parallel.pipe_parallel_size,
                                          parallel.context_parallel_size)
            initialize_expert_parallel(parallel.moe_expert_parallel_size)
            initialize_hybrid_shard(parallel.sharding_group_size)
            try:
                yield
            finally:
                destroy_hybrid_shard()
                destroy_expert_parallel()
                mpu.destroy_model_parallel()
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


def rank_of(run: EngineConfig, world: int, stage: int, tp_rank: int, dp_rank: int = 0) -> int:
    """The global rank at (stage, tp rank, data-parallel rank) of our topology (megatron/mpu/topology.py)."""
    parallel = run.parallel
    topo = build_topology(parallel.model_parallel_size, parallel.pipe_parallel_size, world,
                          parallel.context_parallel_size)
    return int(topo.get_rank(pipe=stage, data=dp_rank, model=tp_rank))


def build_partitions(run: EngineConfig, config: GPTConfig, world: int) -> list[Partition]:
    """Every distinct (stage, tp rank) partition of the model of ``run`` (its vocabulary sized: ``config``) at
    ``world`` ranks, in (stage, tp rank) order."""
    return [build_partition(run, config, world, stage, tp_rank)
            for stage in range(run.parallel.pipe_stages) for tp_rank in range(run.parallel.model_parallel_size)]


def build_partition(run: EngineConfig, config: GPTConfig, world: int, stage: int, tp_rank: int) -> Partition:
    rank = rank_of(run, world, stage, tp_rank)
    objective = build_objective(run.objective)
    if config.value_head != objective.value_head:  # as build_engine sizes the model for its objective
        config = config.replace(value_head=objective.value_head)
    with fake_rank(rank, world, run):
        where = mpu.get_coordinates()
        assert (where.pp, where.tp) == (stage, tp_rank), f"rank {rank} is at {where}, not stage {stage} tp {tp_rank}"
        with deepspeed_prints_quiet(), meta_tensors_stay_on_meta(), torch.device("meta"):
            model, is_pipe = build_model(config, run.parallel, run.activation_config, False, objective, run.lora)
        groups = param_groups(model, run.optimizer_config.applied_weight_decay,
                              run.optimizer_config.weight_decay_embeddings)
    trainable = tuple(tuple(group["params"]) for group in groups)
    blocks = tuple(m.layer_number for m in model.modules() if isinstance(m, Block))
    recomputed, chunks = _recomputed(model, run, is_pipe, blocks)
    # PipelineModule's record of the layers two stages share (the tied embedding), on both of them
    tied = sum(p.numel() for p in model.get_submodule("tied_modules").parameters()) if is_pipe else 0
    modules = _stage_modules(model) if is_pipe else ("GPTModel",)
    return Partition(
        stage=stage, tp_rank=tp_rank, rank=rank, modules=modules,
        blocks=blocks, recomputed_blocks=recomputed, recomputed_chunks=chunks,
        groups=trainable, params=tuple(model.parameters()),
        tied_embedding=tied if run.parallel.pipe_stages > 1 else 0,
        # pipeline_layer_specs: the embedding is the first layer, the head (untied or the tied embedding's
        # logits) the last
        has_embedding=not is_pipe or modules[0] == "EmbeddingPipe",
        has_lm_head=not config.value_head and (not is_pipe or modules[-1] in ("OutputLayerPipe", "tied:EmbeddingPipe")),
    )


def _stage_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The class name of each of a PipelineModule stage's layers, in order (its public ``forward_funcs``); the tied
    head is the embedding's module called through its ``forward_fn``."""
    names = []
    for func in model.forward_funcs:  # type: ignore[union-attr]  # PipelineModule's list of callables
        if isinstance(func, torch.nn.Module):
            names.append(type(func).__name__)
        else:  # PipelineModule's partial(forward_fn, tied module)
            module = getattr(func, "args", (None,))[0]
            names.append(f"tied:{type(module).__name__}")
    return tuple(names)


def _recomputed(model: torch.nn.Module, run: EngineConfig, is_pipe: bool, blocks: tuple[int, ...]) -> tuple[int, int]:
    """(blocks recomputed in the backward, checkpointed chunks) of a built stage."""
    ckpt = run.activation_config
    if not ckpt.recomputes_activations or not blocks:
        return 0, 0
    interval = ckpt.checkpoint_num_layers if ckpt.checkpoint_activations and not ckpt.selective_checkpointing else 0
    if is_pipe and interval:
        # PipelineModule checkpoints chunks of `interval` consecutive layers from the stage's start, a chunk only
        # when every layer of it is in checkpointable_layers (deepspeed/runtime/pipe/module.py:379-382 and
        # :683-685 in 0.19.8): restated, as PipelineModule decides it in its forward
        funcs = list(model.forward_funcs)  # type: ignore[arg-type]  # PipelineModule's list of callables
        recomputed = chunks = 0
        for start in range(0, len(funcs), interval):
            chunk = funcs[start:start + interval]
            if all(type(f).__name__ in CHECKPOINTABLE_LAYERS for f in chunk):
                recomputed += len(chunk)
                chunks += 1
        return recomputed, chunks
    # without a pipeline (or selective checkpointing) our own choice of blocks (engine.wrap_layers)
    chosen = layers_to_checkpoint(ckpt, len(blocks), min(blocks))
    size = 1 if ckpt.selective_checkpointing else ckpt.checkpoint_num_layers
    return len(chosen), len(chosen if size == 1 else chosen[::size])
