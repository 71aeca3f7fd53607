"""Consistency rules between keys that no single component owns, checked before anything is launched.

Each component checks its own keys beside them (``megatron/model/checks.py``,
``megatron/engine/optimizer_checks.py``, ``megatron/data/checks.py``, ...; the list of every module
that registers checks is :data:`megatron.neox_arguments.check_modules.CHECK_MODULES`). What stays here
relates several components at once: the world size against tensor x pipeline x context parallelism,
what context parallelism can split, precision against DeepSpeed's fp16/bf16/data_types blocks and the
device, memory profiling against the device, and ZeRO against pipeline and tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.config_rules import RuleContext, block_enabled, describe, rule, zero_source, zero_stage
from megatron.launcher.checks import runs_on_this_machine
from megatron.logging.config import LoggingArgs
from megatron.objective_needs import needs_of


@rule
def world_splits_into_model_parallel(ctx: RuleContext) -> list[str]:
    if ctx.dp is not None and ctx.dp >= 1:
        return []
    if ctx.cp > 1:
        return [
            f"world size {ctx.world_size} is not divisible by model_parallel_size x pipeline stages x "
            f"context_parallel_size = {ctx.tp} x {ctx.pp} x {ctx.cp} ({ctx.show('model_parallel_size')}, "
            f"{ctx.show('pipe_parallel_size')}, {ctx.show('context_parallel_size')}): {_resize(ctx.tp * ctx.pp * ctx.cp)}"
        ]
    return [
        f"world size {ctx.world_size} is not divisible by model_parallel_size x pipeline stages = "
        f"{ctx.tp} x {ctx.pp} ({ctx.show('model_parallel_size')}, {ctx.show('pipe_parallel_size')}): "
        f"{_resize(ctx.tp * ctx.pp)}"
    ]


def _resize(multiple: int) -> str:
    """What sets the world size, by launch."""
    return (f"start a multiple of {multiple} ranks (deepy.py: num_gpus per node x nodes; torchrun: --nnodes x "
            f"--nproc-per-node; a rehearsal: --rehearse N)")


@rule
def context_parallel_fits(ctx: RuleContext) -> list[str]:
    """What context parallelism (all-to-all over heads, megatron/mpu/context_parallel.py) can split: it
    relates the model's shape, tensor parallelism, the objective and the position encoding, so it stays
    here with the other rules between components."""
    cp = ctx.cp
    if cp == 1:
        return []
    shown, problems = ctx.show("context_parallel_size"), []
    seq = ctx.get("seq_length")
    if isinstance(seq, int) and seq % cp:
        problems.append(f"{shown} does not divide {ctx.show('seq_length')}: each rank holds seq_length / "
                        f"context_parallel_size tokens of every sequence")
    heads, kv = ctx.get("num_attention_heads"), ctx.get("num_kv_heads") or ctx.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(kv, int) and (heads % (ctx.tp * cp) or kv % (ctx.tp * cp)):
        problems.append(f"{shown}: the all-to-all gives each of the {ctx.tp * cp} ranks of model_parallel_size x "
                        f"context_parallel_size a share of the heads; {ctx.show('num_attention_heads')} and "
                        f"num_kv_heads ({kv}) must both be multiples of {ctx.tp * cp}")
    if needs_of(str(ctx.get("train_impl") or "normal")).dataset != "lm":
        problems.append(f"{shown} with {ctx.show('train_impl')}: context parallelism splits language-modelling "
                        "and SFT sequences only; set context_parallel_size: 1")
    if ctx.get("sequence_parallel"):
        problems.append(f"{shown} with {ctx.show('sequence_parallel')} is not supported yet: use one of them")
    if ctx.get("pos_emb") == "rpe":
        problems.append(f"{shown} with {ctx.show('pos_emb')} is not supported yet (the learned per-head biases "
                        "are not split with the heads): use rotary, ALiBi, learned or sinusoidal positions")
    if int(ctx.get("moe_num_experts") or 1) > 1:
        problems.append(f"{shown} with {ctx.show('moe_num_experts')} is not supported yet")
    return problems


_PRECISION_OF_BLOCK = {"fp16": "fp16", "bf16": "bfloat16"}


@rule
def one_half_precision(ctx: RuleContext) -> list[str]:
    if block_enabled(ctx.get("fp16")) and block_enabled(ctx.get("bf16")):
        return [
            f"both fp16 ({describe(ctx.source('fp16'))}) and bf16 ({describe(ctx.source('bf16'))}) "
            f"are enabled: keep one of them (bf16 needs no loss scaling)"
        ]
    return []


@rule
def precision_matches_blocks(ctx: RuleContext) -> list[str]:
    precision = ctx.get("precision")
    if precision is None or not ctx.given("precision"):
        return []
    problems = []
    for block, implied in _PRECISION_OF_BLOCK.items():
        if block_enabled(ctx.get(block)) and ctx.given(block) and precision != implied:
            problems.append(
                f"{ctx.show('precision')} contradicts {block}.enabled=true "
                f"({describe(ctx.source(block))}): set precision: {implied} or disable the {block} block"
            )
    return problems


@rule
def fp16_needs_device_support(ctx: RuleContext) -> list[str]:
    if not block_enabled(ctx.get("fp16")) or ctx.device.fp16_supported:
        return []
    if not runs_on_this_machine(ctx):
        ctx.skipped.append("fp16 support of the devices: the ranks run on other machines (launcher "
                           f"{ctx.get('launcher')}); their devices are trusted")
        return []
    key = "fp16" if ctx.given("fp16") else "precision"
    return [
        f"fp16 needs a GPU: use bf16 or fp32 on CPU ({ctx.show(key)}; DeepSpeed's CPU accelerator "
        f"has no fp16 on this machine)"
    ]


@rule
def nccl_needs_a_gpu(ctx: RuleContext) -> list[str]:
    """``distributed_backend: nccl`` joins the ranks over CUDA GPUs (``initialize.backend_for`` refuses it on a rank
    without one); only a launch (``deepy.py`` names the script) on this machine can be judged by its devices."""
    if ctx.get("distributed_backend") != "nccl" or ctx.device.cuda or ctx.entry_point is None \
            or not runs_on_this_machine(ctx):
        return []
    return [f"{ctx.show('distributed_backend')} needs CUDA GPUs, and the ranks run on this machine, which has none: "
            f"use gloo, or remove the key (gloo on CPU, nccl on GPUs)"]


@rule
def memory_snapshot_needs_a_gpu(ctx: RuleContext) -> list[str]:
    """``memory_profiling`` records the CUDA allocator's history, which needs a GPU where the ranks run; only
    a launch on this machine can be judged by its devices."""
    if not ctx.group(LoggingArgs).memory_profiling or ctx.device.cuda or not runs_on_this_machine(ctx):
        return []
    return [f"{ctx.show('memory_profiling')} records the CUDA allocator's history and this machine has no GPU: "
            f"remove memory_profiling (profile: true writes CPU traces)"]


@rule
def zero_stage_known(ctx: RuleContext) -> list[str]:
    stage = zero_stage(ctx)
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {stage} ({zero_source(ctx)}) does not exist: use 0, 1, 2 or 3")
    block = ctx.get("zero_optimization")
    if isinstance(block, Mapping) and "stage" in block and not (
        isinstance(block["stage"], int) and not isinstance(block["stage"], bool)
    ):
        problems.append(
            f"zero_optimization.stage={block['stage']!r} ({describe(ctx.source('zero_optimization'))}): "
            f"write the stage as a number 0-3"
        )
    raw = ctx.get("zero_stage")
    if raw is not None and not (isinstance(raw, int) and not isinstance(raw, bool)):
        problems.append(
            f"{ctx.show('zero_stage')}: lists and 'all' are for DeepSpeed's autotuner, which Deepy "
            f"does not run; give one stage (0-3)"
        )
    return problems


@rule
def zero_with_pipeline(ctx: RuleContext) -> list[str]:
    stage, pipe = zero_stage(ctx), ctx.pipe_parallel_size
    if stage < 2 or pipe < 1:
        return []
    why = (
        "pipe_parallel_size=1 still wraps the model in DeepSpeed's PipelineModule"
        if pipe == 1
        else "the model runs as a DeepSpeed pipeline"
    )
    return [
        f"ZeRO stage {stage} ({zero_source(ctx)}) with {ctx.show('pipe_parallel_size')}: DeepSpeed's "
        f"PipelineEngine refuses ZeRO-2/3 ({why}); use ZeRO stage 0 or 1 with pipelining, or set "
        f"pipe_parallel_size: 0 to keep ZeRO-{stage}"
    ]


@rule
def zero3_with_tensor_parallel(ctx: RuleContext) -> list[str]:
    if zero_stage(ctx) != 3 or ctx.tp <= 1:
        return []
    # Checked on DeepSpeed 0.19.8 (CPU, gloo): ZeRO-3 with our mpu at tp=2 trains a replicated toy
    # model without complaint, so DeepSpeed does not reject it. Deepy refuses it because ZeRO-3 swaps
    # every parameter for an empty placeholder gathered on demand, while Deepy's tensor-parallel
    # layers, their shard-wise init and the layout-changing checkpoint tools read whole local
    # shards; that combination is untested here and would fail silently, not loudly.
    return [
        f"ZeRO stage 3 ({zero_source(ctx)}) with {ctx.show('model_parallel_size')} is not supported "
        f"by Deepy: ZeRO-3 re-partitions the weights tensor parallelism already split; use ZeRO "
        f"stage 1 or 2 with tensor parallelism, or model_parallel_size: 1 with ZeRO-3"
    ]


_DTYPE_NAMES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


@rule
def data_types_match_precision(ctx: RuleContext) -> list[str]:
    """DeepSpeed's data_types block against the training dtype (what 0.19.8 raises on)."""
    block = ctx.get("data_types")
    if not isinstance(block, Mapping):
        return []
    model = "fp16" if block_enabled(ctx.get("fp16")) else "bf16" if block_enabled(ctx.get("bf16")) else "fp32"
    problems = []
    where = describe(ctx.source("data_types"))
    param = _DTYPE_NAMES.get(str(block.get("param_dtype")).lower()) if block.get("param_dtype") else None
    if param is not None and param != model:
        problems.append(
            f"data_types.param_dtype={block['param_dtype']} ({where}) but the run trains in {model} "
            f"(precision={ctx.get('precision')}): DeepSpeed refuses the mismatch; remove param_dtype"
        )
    accum = _DTYPE_NAMES.get(str(block.get("grad_accum_dtype")).lower()) if block.get("grad_accum_dtype") else None
    if accum is not None and accum != model and zero_stage(ctx) == 0:
        problems.append(
            f"data_types.grad_accum_dtype={block['grad_accum_dtype']} ({where}) differs from the "
            f"training dtype {model} without ZeRO: DeepSpeed 0.19.8 raises 'unsupported mix'; use "
            f"zero_optimization stage 1 or more, or remove grad_accum_dtype"
        )
    return problems
