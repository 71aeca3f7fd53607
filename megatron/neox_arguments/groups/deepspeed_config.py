"""Keys that go into the DeepSpeed config JSON handed to ``deepspeed.initialize``.

Blocks are kept as plain dicts because DeepSpeed validates their inside; the split that builds the
DeepSpeed config lives in the rules/derived modules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, obsolete
from megatron.launcher.config import AUTOTUNING_REFUSED


class DeepSpeedConfigArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsDeepspeedConfig`` group."""

    deepspeed: bool = obsolete(True, (
        "GPT-NeoX trains only through a DeepSpeed engine (megatron/training.py), as Deepy does; false turns "
        "nothing off: remove the key"))
    """Train through a DeepSpeed engine; Deepy has no other engine, so it cannot be turned off."""

    train_batch_size: int | None = Field(None, ge=1)
    """Global batch size in samples: micro batch x gradient accumulation x data-parallel size."""

    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per forward/backward on one data-parallel rank."""

    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches accumulated before each optimizer step."""

    scheduler: dict[str, Any] | None = obsolete(None, (
        "DeepSpeed's own LR scheduler block, which GPT-NeoX fills in itself only for OneBitAdam "
        "(megatron/neox_arguments/arguments.py) and otherwise schedules from lr_decay_style; so does Deepy: "
        "use lr_decay_style, warmup, min_lr and lr_decay_iters"))
    """DeepSpeed's own LR scheduler block (WarmupLR, ...). Obsolete: Deepy's schedule comes from
    lr_decay_style, warmup, min_lr and lr_decay_iters, and a second scheduler would fight it."""

    fp32_allreduce: bool = False
    """All-reduce gradients in fp32 even when training in half precision."""

    prescale_gradients: bool = False
    """Divide gradients by the data-parallel size before the all-reduce instead of after."""

    gradient_predivide_factor: float = Field(1.0, gt=0)
    """Divide gradients by this before the all-reduce and the rest after, avoiding fp16 overflow."""

    sparse_gradients: bool = obsolete(False, (
        "DeepSpeed 0.19.8 removed sparse embedding gradients and refuses the key: remove it"))
    """Let DeepSpeed all-reduce sparse embedding gradients as sparse tensors (DeepSpeed 0.19.8 removed
    the feature and refuses the key)."""

    fp16: dict[str, Any] | None = None
    """DeepSpeed fp16 block: {enabled, loss_scale, initial_scale_power, loss_scale_window,
    hysteresis, min_loss_scale}."""

    bf16: dict[str, Any] | None = None
    """DeepSpeed bf16 block: {enabled: true}."""

    amp: dict[str, Any] | None = obsolete(None, (
        "NVIDIA Apex's automatic mixed precision: DeepSpeed 0.19.8 removed the block and refuses it; use "
        "precision: bfloat16 or fp16 (the bf16/fp16 blocks)"))
    """DeepSpeed block for NVIDIA apex automatic mixed precision."""

    gradient_clipping: float = Field(1.0, ge=0)
    """Gradient-norm clipping threshold handed to DeepSpeed; mirrors clip_grad."""

    zero_optimization: dict[str, Any] | None = None
    """DeepSpeed ZeRO block: {stage, reduce_bucket_size, overlap_comm, offload_optimizer, ...}."""

    steps_per_print: int = Field(10, ge=1)
    """DeepSpeed prints its own progress line every this many steps, shown when deepspeed_log_level is info
    or debug (deepy.py --verbose); Deepy's own line comes every log_interval."""

    wall_clock_breakdown: bool = False
    """DeepSpeed times forward, backward and optimizer step separately."""

    dump_state: bool = False
    """DeepSpeed prints its full engine state after initialisation."""

    flops_profiler: dict[str, Any] | None = None
    """DeepSpeed flops profiler block."""

    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    """Dtype for gradient communication (`fp16`, `bf16` or `fp32`). GPT-NeoX types this as bool, but
    DeepSpeed expects a dtype name."""

    autotuning: dict[str, Any] | None = obsolete(None, AUTOTUNING_REFUSED)
    """DeepSpeed autotuner block (tuning space, metric, profile steps). Refused: DeepSpeed 0.19.8's autotuner
    re-runs the training script with configs of its own that skip deepy.py's checks (see autotuning_run)."""

    sparse_attention: dict[str, Any] | None = obsolete(None, (
        "DeepSpeed 0.19.8 removed Sparse Attention and refuses the block (runtime/config.py "
        "_REMOVED_TOP_LEVEL_CONFIG_KEYS: 'DeepSpeed Sparse Attention has been removed'): remove it; for sparse "
        "or local attention patterns use attention_config (e.g. local or flash attention types)"))
    """DeepSpeed sparse attention block. DeepSpeed 0.19.8 removed Sparse Attention and refuses the block."""

    tensorboard: dict[str, Any] | None = None
    """DeepSpeed's own TensorBoard monitor block."""

    wandb: dict[str, Any] | None = None
    """DeepSpeed's own W&B monitor block."""

    csv_monitor: dict[str, Any] | None = None
    """DeepSpeed's CSV monitor block."""

    elasticity: dict[str, Any] | None = obsolete(None, (
        "DeepSpeed 0.19.8 removed elastic training and refuses the block (runtime/config.py "
        "_REMOVED_TOP_LEVEL_CONFIG_KEYS: 'Elastic training has been removed'): set train_batch_size, "
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps directly"))
    """DeepSpeed elastic-training block (batch size adapts to the node count). DeepSpeed 0.19.8 removed elastic
    training and refuses the block."""

    comms_logger: dict[str, Any] | None = None
    """DeepSpeed communication logger block ({enabled, prof_all, prof_ops, verbose, debug}): DeepSpeed times its
    collectives and Deepy prints its summary after the last step (with verbose, at every log_interval too)."""

    compression_training: dict[str, Any] | None = obsolete(None, (
        "DeepSpeed 0.19.8 removed its compression library and refuses the block (runtime/config.py "
        "_REMOVED_TOP_LEVEL_CONFIG_KEYS: 'The DeepSpeed compression library has been removed ... the model would "
        "train unquantized'): remove it; train in bf16/fp16 and quantise after training (e.g. export to Hugging "
        "Face and use a post-training quantiser)"))
    """DeepSpeed compression (quantisation/pruning during training) block. DeepSpeed 0.19.8 removed its
    compression library and refuses the block."""

    checkpoint: dict[str, Any] | None = None
    """DeepSpeed checkpoint block, e.g. {use_node_local_storage: true}."""

    data_types: dict[str, Any] | None = None
    """DeepSpeed data-types block, e.g. {grad_accum_dtype: fp32}."""

    deepspeed_extra_args: dict[str, Any] | None = None
    """Any further DeepSpeed config keys, merged into the generated DeepSpeed config as given."""
