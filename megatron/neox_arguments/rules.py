"""Consistency rules between the keys of several components, checked before anything is launched.

The machinery (``RuleContext``, ``rule``, ``check``) lives in :mod:`megatron.config_rules`, below every
component, so a component registers the checks of its own keys beside them; importing this module
imports those components too, so :func:`check` sees every rule. What stays here relates keys that no
single component owns (the world size against tp x pp x cp, precision against the DeepSpeed blocks, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.errors import ConfigError
from megatron.logging.preflight import logging_problems
from megatron.config_rules import Device, RuleContext, default_of, describe, render, rule
from megatron.data.config import SPLITS
from megatron.training.optimizer_config import peak_lr_setting
from megatron.training.lr_schedules import min_lr_problem

# components whose own checks register on import (checks beside the keys they protect)
from megatron.training import lr_config as _lr_checks  # noqa: F401  isort: skip
from megatron.training.objectives import checks as _objective_checks  # noqa: F401  isort: skip

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs
from megatron.time_phrases import TimePhraseError, parse_duration


# where DeepSpeed's runner looks for a hostfile when none is configured
DEEPSPEED_DEFAULT_HOSTFILE = "/job/hostfile"

# --- shared readings of multi-spelling settings -------------------------------------------------
def block_enabled(block: Any) -> bool:
    """DeepSpeed reads ``fp16: {}`` as disabled and ``fp16: {enabled: true}`` as enabled."""
    return isinstance(block, Mapping) and bool(block.get("enabled", False))


def zero_stage(ctx: RuleContext) -> int:
    """The ZeRO stage DeepSpeed will use (``zero_optimization.stage`` after derivation)."""
    block = ctx.get("zero_optimization")
    if isinstance(block, Mapping) and isinstance(block.get("stage"), int):
        return int(block["stage"])
    stage = ctx.get("zero_stage")
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0


def effective_lr(ctx: RuleContext) -> tuple[float | None, str]:
    """The peak learning rate and the key that holds it (``lr`` or ``optimizer.params.lr``), as the
    optimizer decides it (:func:`~megatron.training.optimizer_config.peak_lr_setting`)."""
    return peak_lr_setting(ctx.get("lr"), ctx.get("optimizer"))


# --- model shape ------------------------------------------------------------------------------
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


@rule
def model_shape_given(ctx: RuleContext) -> list[str]:
    missing = [key for key in MODEL_SHAPE_KEYS if ctx.get(key) is None]
    if not missing:
        return []
    return [f"{', '.join(missing)} not set: every model needs {', '.join(MODEL_SHAPE_KEYS)}"]


@rule
def heads_divide_hidden(ctx: RuleContext) -> list[str]:
    hidden, heads = ctx.get("hidden_size"), ctx.get("num_attention_heads")
    if hidden is None or heads is None or hidden % heads == 0:
        return []
    return [
        f"{ctx.show('hidden_size')} is not divisible by {ctx.show('num_attention_heads')}: each "
        f"head gets hidden_size/num_attention_heads channels; pick a head count that divides "
        f"{hidden}"
    ]


@rule
def heads_divide_over_tp(ctx: RuleContext) -> list[str]:
    heads = ctx.get("num_attention_heads")
    if heads is None or heads % ctx.tp == 0:
        return []
    return [
        f"{ctx.show('num_attention_heads')} is not divisible by {ctx.show('model_parallel_size')}: "
        f"tensor parallelism gives each rank whole heads; use a model_parallel_size that divides "
        f"{heads}"
    ]


@rule
def kv_heads_fit(ctx: RuleContext) -> list[str]:
    heads, kv = ctx.get("num_attention_heads"), ctx.get("num_kv_heads")
    if heads is None or kv is None:
        return []
    problems = []
    if kv > heads or heads % kv != 0:
        problems.append(
            f"{ctx.show('num_kv_heads')} does not divide {ctx.show('num_attention_heads')}: grouped "
            f"query attention shares each key/value head among heads/num_kv_heads query heads"
        )
    tp = ctx.tp
    # The attention layer splits key/value heads across tensor-parallel ranks; replicating one kv
    # head over several ranks (tp > kv) is not implemented, so kv must be a multiple of tp.
    if kv % tp != 0:
        problems.append(
            f"{ctx.show('num_kv_heads')} is not divisible by {ctx.show('model_parallel_size')}: each "
            f"tensor-parallel rank holds whole key/value heads; use a model_parallel_size that divides "
            f"num_kv_heads"
        )
    return problems


@rule
def layers_cover_stages(ctx: RuleContext) -> list[str]:
    layers, stages = ctx.get("num_layers"), int(ctx.get("pipe_parallel_size") or 0)
    if layers is None or stages <= 1 or layers >= stages:
        return []
    return [
        f"{ctx.show('num_layers')} is fewer than {ctx.show('pipe_parallel_size')}: every pipeline "
        f"stage needs at least one transformer layer; lower pipe_parallel_size to {layers} or less"
    ]


@rule
def sequence_fits_positions(ctx: RuleContext) -> list[str]:
    seq, positions = ctx.get("seq_length"), ctx.get("max_position_embeddings")
    if seq is None or positions is None or seq <= positions:
        return []
    return [
        f"{ctx.show('seq_length')} exceeds {ctx.show('max_position_embeddings')}: raise "
        f"max_position_embeddings to at least {seq} (or remove it to default to seq_length)"
    ]


@rule
def rope_scaling_is_honoured(ctx: RuleContext) -> list[str]:
    """rope_scaling is HF's dict of one of its kinds, and only rotary positions can be scaled."""
    value = ctx.get("rope_scaling")
    if value is None:
        return []
    if ctx.get("pos_emb") != "rotary":
        return [f"{ctx.show('rope_scaling')} scales rotary positions, but {ctx.show('pos_emb')}: set pos_emb: "
                "rotary or remove rope_scaling"]
    from megatron.model.rope_scaling import RopeScalingError, parse_rope_scaling

    try:
        parse_rope_scaling(value, ctx.get("max_position_embeddings") or ctx.get("seq_length"))
    except RopeScalingError as err:
        return [f"{ctx.show('rope_scaling')}: {err}"]
    return []


@rule
def vocab_padding_splits_over_tp(ctx: RuleContext) -> list[str]:
    padded = ctx.get("padded_vocab_size")
    if padded is None or not ctx.given("padded_vocab_size"):
        return []
    multiple = int(ctx.get("make_vocab_size_divisible_by") or 1) * ctx.tp
    if padded % multiple == 0:
        return []
    return [
        f"{ctx.show('padded_vocab_size')} is not a multiple of make_vocab_size_divisible_by x "
        f"model_parallel_size = {multiple}: each tensor-parallel rank holds an equal slice of the "
        f"vocabulary; remove padded_vocab_size so it is computed from the tokenizer"
    ]


# --- parallel layout --------------------------------------------------------------------------
@rule
def world_splits_into_model_parallel(ctx: RuleContext) -> list[str]:
    if ctx.dp is not None and ctx.dp >= 1:
        return []
    if ctx.cp > 1:
        return [
            f"world size {ctx.world_size} is not divisible by model_parallel_size x pipeline stages x "
            f"context_parallel_size = {ctx.tp} x {ctx.pp} x {ctx.cp} ({ctx.show('model_parallel_size')}, "
            f"{ctx.show('pipe_parallel_size')}, {ctx.show('context_parallel_size')}): set num_gpus (ranks per "
            f"node) so the world size is a multiple of {ctx.tp * ctx.pp * ctx.cp}"
        ]
    return [
        f"world size {ctx.world_size} is not divisible by model_parallel_size x pipeline stages = "
        f"{ctx.tp} x {ctx.pp} ({ctx.show('model_parallel_size')}, {ctx.show('pipe_parallel_size')}): "
        f"set num_gpus (ranks per node) so the world size is a multiple of {ctx.tp * ctx.pp}"
    ]


@rule
def context_parallel_fits(ctx: RuleContext) -> list[str]:
    """What context parallelism (all-to-all over heads, megatron/mpu/context_parallel.py) can split: it
    relates the model's shape, tensor parallelism, the objective and the position encoding, so it stays
    here with the other rules between components."""
    from megatron.training.objectives.registry import needs_of

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


# --- precision --------------------------------------------------------------------------------
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


def runs_on_this_machine(ctx: RuleContext) -> bool:
    """A single-node launch from here: only then does this machine's device say anything.

    deepy.py often runs on a login node without GPUs that pdsh/srun/mpirun launch from: a hostfile
    that exists, several nodes, ``force_multi``, ``launcher: slurm`` (srun on the allocation's nodes)
    or srun/mpirun starting the ranks themselves (``deepspeed_slurm``/``deepspeed_mpi``) all mean the
    ranks run elsewhere, with the ``num_gpus``/``num_nodes`` the user gave.
    """
    return not launches_elsewhere(ctx.args)


def launches_elsewhere(args: NeoXArgs) -> bool:
    hostfile = args.hostfile or (DEEPSPEED_DEFAULT_HOSTFILE if os.path.isfile(DEEPSPEED_DEFAULT_HOSTFILE) else None)
    return bool(
        (hostfile and os.path.isfile(hostfile))
        or args.force_multi
        or (args.num_nodes or -1) > 1
        or args.launcher == "slurm"
        or args.deepspeed_slurm
        or args.deepspeed_mpi
    )


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


# --- ZeRO x parallelism (what DeepSpeed 0.19.8 rejects or that Deepy cannot keep correct) -------
@rule
def zero_stage_known(ctx: RuleContext) -> list[str]:
    stage = zero_stage(ctx)
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {stage} ({_zero_source(ctx)}) does not exist: use 0, 1, 2 or 3")
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
    stage, pipe = zero_stage(ctx), int(ctx.get("pipe_parallel_size") or 0)
    if stage < 2 or pipe < 1:
        return []
    why = (
        "pipe_parallel_size=1 still wraps the model in DeepSpeed's PipelineModule"
        if pipe == 1
        else "the model runs as a DeepSpeed pipeline"
    )
    return [
        f"ZeRO stage {stage} ({_zero_source(ctx)}) with {ctx.show('pipe_parallel_size')}: DeepSpeed's "
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
        f"ZeRO stage 3 ({_zero_source(ctx)}) with {ctx.show('model_parallel_size')} is not supported "
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


def _zero_source(ctx: RuleContext) -> str:
    if ctx.given("zero_stage"):
        return f"zero_stage at {describe(ctx.source('zero_stage'))}"
    return f"zero_optimization.stage at {describe(ctx.source('zero_optimization'))}"


# --- optimisation -----------------------------------------------------------------------------
@rule
def learning_rates_ordered(ctx: RuleContext) -> list[str]:
    lr, lr_key = effective_lr(ctx)
    min_lr = ctx.get("min_lr")
    problems = []
    if lr is None:
        problems.append("no learning rate: set lr (or optimizer.params.lr)")
    if min_lr is not None and min_lr < 0:
        problems.append(f"{ctx.show('min_lr')} is negative: use 0 or more")
    if lr is not None and min_lr is not None:
        shown = ctx.show("lr") if lr_key == "lr" else f"optimizer.params.lr={lr} ({describe(ctx.source('optimizer'))})"
        ordered = min_lr_problem(lr, min_lr, shown, ctx.show("min_lr"))
        if ordered:
            problems.append(ordered)
    optimizer = ctx.get("optimizer")
    if ctx.get("lr") is not None and optimizer is not None:
        block_lr = optimizer.params.lr
        if block_lr is not None and float(block_lr) != float(ctx.get("lr")):
            problems.append(
                f"{ctx.show('lr')} and optimizer.params.lr={block_lr} "
                f"({describe(ctx.source('optimizer'))}) disagree: keep one of them"
            )
    return problems


@rule
def one_weight_decay(ctx: RuleContext) -> list[str]:
    optimizer = ctx.get("optimizer")
    block_wd = optimizer.params.weight_decay if optimizer is not None else None
    if block_wd is None or not ctx.given("weight_decay") or float(block_wd) == float(ctx.get("weight_decay")):
        return []
    return [
        f"{ctx.show('weight_decay')} and optimizer.params.weight_decay={block_wd} "
        f"({describe(ctx.source('optimizer'))}) disagree: they are one setting, keep one of them"
    ]


@rule
def optimizer_type_agrees(ctx: RuleContext) -> list[str]:
    """The flat ``optimizer_type`` and the block's ``type`` name one optimizer."""
    from megatron.training.optimizer_block import OPTIMIZER_KINDS

    optimizer = ctx.get("optimizer")
    if optimizer is None or not ctx.given("optimizer_type"):
        return []
    if OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower()) == optimizer.kind:
        return []
    return [
        f"{ctx.show('optimizer_type')} but optimizer.type={optimizer.type!r} "
        f"({describe(ctx.source('optimizer'))}): keep one of them"
    ]


@rule
def onebit_adam_needs_its_backend(ctx: RuleContext) -> list[str]:
    """DeepSpeed's 1-bit Adam compresses gradients with NCCL or MPI collectives on GPUs."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else str(ctx.get("optimizer_type")).lower()
    if kind != "onebitadam":
        return []
    problems = []
    if runs_on_this_machine(ctx) and not ctx.device.cuda:
        problems.append(
            "optimizer.type=OneBitAdam needs GPUs: DeepSpeed's 1-bit Adam communicates through NCCL or MPI "
            "(gloo on CPU is not supported); use Adam here"
        )
    if zero_stage(ctx) > 0:
        problems.append("optimizer.type=OneBitAdam does not work with ZeRO (DeepSpeed's 1-bit Adam "
                        "communicates the full gradients itself); use zero stage 0")
    return problems


@rule
def iterations_or_epochs(ctx: RuleContext) -> list[str]:
    iters, epochs = ctx.get("train_iters"), ctx.get("train_epochs")
    if iters is not None and epochs is not None:
        return [f"both {ctx.show('train_iters')} and {ctx.show('train_epochs')} are set: keep one"]
    if iters is None and epochs is None:
        return ["neither train_iters nor train_epochs is set: give the training length as one of them"]
    return []


# --- checkpoints ------------------------------------------------------------------------------
SAVE_SCHEDULE_KEYS = ("checkpoint_factor", "extra_save_iters", "save_interval", "keep")


@rule
def save_has_schedule(ctx: RuleContext) -> list[str]:
    scheduled = [key for key in SAVE_SCHEDULE_KEYS if ctx.get(key) not in (None, [], "")]
    if ctx.get("save") and not scheduled:
        return [
            f"{ctx.show('save')} but no save schedule: add checkpoint_factor (save every N steps), "
            f"extra_save_iters, save_interval (e.g. 15min) or keep"
        ]
    if scheduled and not ctx.get("save"):
        shown = ", ".join(ctx.show(key) for key in scheduled)
        return [f"{shown} but save (the checkpoint directory) is not set: add save: <dir> or remove them"]
    return []


@rule
def save_interval_is_duration(ctx: RuleContext) -> list[str]:
    value = ctx.get("save_interval")
    if value is None:
        return []
    try:
        parse_duration(value)
    except TimePhraseError as err:
        return [f"{ctx.show('save_interval')}: {err}"]
    return []


# --- data ---------------------------------------------------------------------------------------


@rule
def one_data_source(ctx: RuleContext) -> list[str]:
    split_keys = [f"{split}_data_paths" for split in SPLITS if ctx.get(f"{split}_data_paths")]
    problems = []
    if ctx.get("data_path") and split_keys:
        shown = ", ".join(ctx.show(key) for key in split_keys)
        problems.append(
            f"{ctx.show('data_path')} and {shown} both name data: data_path is split by `split`, the "
            f"*_data_paths lists are used as given; keep one way"
        )
    if ctx.get("train_urls") and (ctx.get("data_path") or split_keys):
        problems.append(
            f"{ctx.show('train_urls')} and tokenized data paths are both set: train from raw text "
            f"(train_urls) or from .bin/.idx files (data_path / *_data_paths), not both"
        )
    if split_keys and not ctx.get("train_data_paths"):
        problems.append(f"{', '.join(ctx.show(k) for k in split_keys)} without train_data_paths: add train_data_paths")
    # pairwise (DPO) data comes as pos_/neg_ lists; an online dataset is served, not read from disk
    has_data = any(ctx.get(key) for key in ("data_path", "train_data_paths", "train_urls", "pos_train_data_paths"))
    if not has_data and not ctx.get("use_dummy_dataset") and ctx.get("dataset_impl") != "online":
        problems.append(
            "no training data: set data_path, train_data_paths (pos_/neg_train_data_paths for pairwise "
            "data) or train_urls (or use_dummy_dataset: true for random tokens)"
        )
    if bool(ctx.get("pos_train_data_paths")) != bool(ctx.get("neg_train_data_paths")):
        given = "pos_train_data_paths" if ctx.get("pos_train_data_paths") else "neg_train_data_paths"
        problems.append(f"{ctx.show(given)} without its pair: pairwise data needs both pos_ and neg_ lists")
    return problems


@rule
def weights_match_paths(ctx: RuleContext) -> list[str]:
    problems = []
    for split in SPLITS:
        paths, weights = ctx.get(f"{split}_data_paths"), ctx.get(f"{split}_data_weights")
        if weights is None:
            continue
        if paths is None:
            problems.append(f"{ctx.show(f'{split}_data_weights')} without {split}_data_paths to weight")
        elif len(weights) != len(paths):
            problems.append(
                f"{split}_data_weights has {len(weights)} entries ({describe(ctx.source(f'{split}_data_weights'))}) "
                f"but {split}_data_paths has {len(paths)} ({describe(ctx.source(f'{split}_data_paths'))}): "
                f"give one weight per path"
            )
    return problems


@rule
def labels_match_paths(ctx: RuleContext) -> list[str]:
    problems = []
    for prefix in ("", "pos_", "neg_"):
        for split in SPLITS:
            label_key = f"{prefix}{split}_label_data_paths"
            data_key = f"{prefix}{split}_data_paths"
            labels, paths = ctx.get(label_key), ctx.get(data_key)
            if labels is None:
                continue
            if paths is None or len(labels) != len(paths):
                count = 0 if paths is None else len(paths)
                problems.append(
                    f"{label_key} has {len(labels)} entries ({describe(ctx.source(label_key))}) but "
                    f"{data_key} has {count}: give one label file per data file"
                )
    return problems


@rule
def urls_need_cache(ctx: RuleContext) -> list[str]:
    urls = [key for key in ("train_urls", "validation_urls") if ctx.get(key)]
    if not urls or ctx.get("cache_dir"):
        return []
    return [f"{ctx.show(urls[0])} needs cache_dir: the tokenized shards are written there"]


# --- launch -----------------------------------------------------------------------------------
@rule
def slurm_only_keys(ctx: RuleContext) -> list[str]:
    launcher = ctx.get("launcher") or "pdsh"
    keys = [key for key in ("comment", "account") if ctx.get(key)]
    if not keys or launcher == "slurm":
        return []
    return [f"{', '.join(ctx.show(k) for k in keys)} only apply to srun: set launcher: slurm or remove them"]


@rule
def one_environment_mapping(ctx: RuleContext) -> list[str]:
    if ctx.get("deepspeed_mpi") and ctx.get("deepspeed_slurm"):
        return [
            f"both {ctx.show('deepspeed_mpi')} and {ctx.show('deepspeed_slurm')}: ranks take their "
            f"rank/world size from MPI or from Slurm, keep one"
        ]
    return []


# --- logging, trackers, profiling ---------------------------------------------------------------
@rule
def trackers_and_profiling(ctx: RuleContext) -> list[str]:
    """Trackers importable, one spelling each, profiling ranges and devices (megatron/logging/preflight.py)."""
    try:
        return logging_problems(ctx.args, ctx.show, local=runs_on_this_machine(ctx), cuda=ctx.device.cuda)
    except ConfigError as err:  # the tracker spellings disagree (LoggingArgs.tracker_settings)
        return [err.message]


# --- mixture of experts (moe_* keys) -------------------------------------------------------------
# One block so the MoE rules can be read (and merged) together.
MOE_DEFAULTS_IRRELEVANT_WHEN_DENSE = (
    "moe_top_k", "moe_router_type", "moe_expert_interval", "moe_lbl_in_fp32", "moe_jitter_eps",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_parallel_size",
)  # fmt: skip


@rule
def moe_keys_need_experts(ctx: RuleContext) -> list[str]:
    if int(ctx.get("moe_num_experts") or 1) > 1:
        return []
    changed = [key for key in MOE_DEFAULTS_IRRELEVANT_WHEN_DENSE if ctx.get(key) != default_of(ctx.args, key)]
    if not changed:
        return []
    return [
        f"{', '.join(ctx.show(key) for key in changed)} but {ctx.show('moe_num_experts')}: these only "
        f"configure MoE layers, and a model with one expert has none; set moe_num_experts to 2 or more, "
        f"or remove them"
    ]


@rule
def moe_top_k_fits(ctx: RuleContext) -> list[str]:
    experts, k = int(ctx.get("moe_num_experts") or 1), int(ctx.get("moe_top_k") or 1)
    if experts <= 1 or k <= experts:
        return []
    return [f"{ctx.show('moe_top_k')} exceeds {ctx.show('moe_num_experts')}: a token can visit each expert once"]


@rule
def moe_experts_split_evenly(ctx: RuleContext) -> list[str]:
    experts = int(ctx.get("moe_num_experts") or 1)
    ep = int(ctx.get("moe_expert_parallel_size") or 1)
    if experts <= 1:
        return []
    problems = []
    if experts % (ctx.tp * ep) != 0:
        problems.append(
            f"{ctx.show('moe_num_experts')} is not divisible by {ctx.show('model_parallel_size')} x "
            f"{ctx.show('moe_expert_parallel_size')} = {ctx.tp * ep}: each of those ranks holds an equal "
            f"share of whole experts; use a multiple of {ctx.tp * ep} experts or smaller parallel sizes"
        )
    if ep > 1 and ctx.dp is not None and ctx.dp % ep != 0:
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} does not divide the data-parallel size {ctx.dp} "
            f"(world size {ctx.world_size} / model_parallel_size {ctx.tp} / pipeline stages {ctx.pp}): "
            f"experts are split over groups of that many data-parallel ranks; pick a divisor of {ctx.dp}"
        )
    return problems




# ==== LoRA adapters (megatron/model/lora.py) =====================================================
_LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_target_modules")
_LORA_MLP_TARGETS = ("dense_h_to_4h", "dense_4h_to_h")


@rule
def lora_keys_need_a_rank(ctx: RuleContext) -> list[str]:
    if int(ctx.get("lora_r") or 0) > 0:
        return []
    given = [key for key in _LORA_KEYS if ctx.given(key)]
    if not given:
        return []
    return [f"{', '.join(ctx.show(k) for k in given)} but {ctx.show('lora_r')}: these configure LoRA adapters, "
            "and lora_r 0 trains without any; set lora_r (e.g. 8) or remove them"]


@rule
def lora_mlp_targets_need_dense_mlps(ctx: RuleContext) -> list[str]:
    if int(ctx.get("lora_r") or 0) == 0 or int(ctx.get("moe_num_experts") or 1) <= 1:
        return []
    mlp = [t for t in ctx.get("lora_target_modules") or [] if t in _LORA_MLP_TARGETS]
    if not mlp:
        return []
    return [f"{ctx.show('lora_target_modules')} with {ctx.show('moe_num_experts')}: adapters on the experts of MoE "
            f"layers are not built yet, so {mlp} would stay unadapted there; target query_key_value/dense only"]


@rule
def moe_expert_parallel_over_dp_needs_fp32_without_zero(ctx: RuleContext) -> list[str]:
    ep = int(ctx.get("moe_expert_parallel_size") or 1)
    if ep <= 1 or int(ctx.get("moe_num_experts") or 1) <= 1:
        return []
    problems = []
    stage = zero_stage(ctx)
    if stage != 0:
        # DeepSpeed's ZeRO optimizers partition and all-gather parameters over the whole
        # data-parallel group, which assumes every data-parallel rank holds the same parameters;
        # its own expert support is tied to its MoE layer class and checkpoint format.
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} with ZeRO stage {stage} ({_zero_source(ctx)}) is not "
            f"supported yet: ZeRO shards the optimizer over data-parallel ranks that would hold different "
            f"experts; use ZeRO stage 0, or moe_expert_parallel_size: 1 (experts split over "
            f"model_parallel_size only, which works with every ZeRO stage)"
        )
    half = block_enabled(ctx.get("fp16")) or block_enabled(ctx.get("bf16")) or ctx.get("precision") in (
        "fp16", "bfloat16")  # fmt: skip
    if half:
        # DeepSpeed's fp16/bf16 optimizers reduce their own flat fp32 gradient buffers, which Deepy's
        # expert-gradient reduction (over the ranks that hold the same experts) does not reach.
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} with precision={ctx.get('precision')} is not supported "
            f"yet: expert parallelism over data-parallel ranks trains in fp32 only; set precision: fp32, "
            f"or moe_expert_parallel_size: 1"
        )
    return problems
