"""Rules for DeepSpeed blocks and activation-checkpointing keys that only take effect on some layouts.

A block DeepSpeed accepts but never acts on where the run happens would be a key accepted and
ignored, so each is refused there, naming why (``tests/distributed/test_deepspeed_blocks.py`` builds both
engines, plain and ``PipelineModule``, and reads DeepSpeed's state to keep this list true):

* ``flops_profiler`` on a pipeline: ``PipelineEngine`` starts and stops the profile in its forward, but
  only ``DeepSpeedEngine.step`` prints it, and the pipeline never calls ``step``.
* the ``activation_checkpointing`` block when nothing is checkpointed, and ``checkpoint_num_layers``
  with selective checkpointing; GPT-NeoX's flat options with checkpointing off are said (a warning
  ``--dry-run`` lists) because GPT-NeoX's own configs set them.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.config_rules import RuleContext, describe, rule
from megatron.engine.activation_config import ACTIVATION_BLOCK_KEYS

CHECKPOINT_OPTION_KEYS = ("partition_activations", "contiguous_checkpointing", "checkpoint_in_cpu",
                          "synchronize_each_layer", "profile_backward")


def _checkpointing_on(ctx: RuleContext) -> bool:
    return bool(ctx.get("checkpoint_activations")) or ctx.get("selective_checkpointing") is not None


@rule
def activation_checkpointing_block_is_read(ctx: RuleContext) -> list[str]:
    """The DeepSpeed block is another spelling of the flat keys: known keys only, no disagreement."""
    block = ctx.get("activation_checkpointing")
    if not isinstance(block, Mapping):
        return []
    where = describe(ctx.source("activation_checkpointing"))
    problems = []
    for key, value in block.items():
        flat = ACTIVATION_BLOCK_KEYS.get(key)
        if flat is None:
            problems.append(f"activation_checkpointing.{key} ({where}) is not a DeepSpeed activation "
                            f"checkpointing option; use one of {', '.join(ACTIVATION_BLOCK_KEYS)}")
        elif flat != "number_checkpoints" and ctx.given(flat) and bool(ctx.get(flat)) != bool(value):
            problems.append(f"activation_checkpointing.{key}={value} ({where}) and {ctx.show(flat)} disagree: "
                            f"they are one setting, keep one of them")
    return problems


@rule
def checkpoint_options_need_checkpointing(ctx: RuleContext) -> list[str]:
    """Options of activation checkpointing change nothing when no block is checkpointed.

    The DeepSpeed block is refused; GPT-NeoX's own configs set the flat keys with checkpointing off
    (pythia/14M: ``synchronize-each-layer: true``) and must load unchanged, so those are said
    (``--dry-run`` and every launch print it) rather than refused."""
    if _checkpointing_on(ctx):
        return []
    ignored = [ctx.show(key) for key in CHECKPOINT_OPTION_KEYS if ctx.get(key)]
    if int(ctx.get("checkpoint_num_layers") or 1) != 1:
        ignored.append(ctx.show("checkpoint_num_layers"))
    if ignored:
        ctx.warnings.append(f"ignored: {', '.join(ignored)}: no activations are checkpointed "
                            f"(checkpoint_activations is false), so this changes nothing")
    block = ctx.get("activation_checkpointing")
    if isinstance(block, Mapping) and any(block.values()):
        return [f"activation_checkpointing ({describe(ctx.source('activation_checkpointing'))}): no activations "
                f"are checkpointed (checkpoint_activations is false), so the block changes nothing; set "
                f"checkpoint_activations: true or remove it"]
    return []


@rule
def checkpoint_num_layers_has_effect(ctx: RuleContext) -> list[str]:
    if int(ctx.get("checkpoint_num_layers") or 1) == 1 or ctx.get("selective_checkpointing") is None:
        return []
    return [f"{ctx.show('checkpoint_num_layers')} with {ctx.show('selective_checkpointing')}: selective "
            f"checkpointing recomputes single blocks, so the chunk size changes nothing; remove one"]


@rule
def flops_profiler_needs_the_plain_engine(ctx: RuleContext) -> list[str]:
    block = ctx.get("flops_profiler")
    if not (isinstance(block, Mapping) and block.get("enabled")) or not ctx.uses_pipeline_module:
        return []
    return [f"flops_profiler.enabled ({describe(ctx.source('flops_profiler'))}) with "
            f"{ctx.show('pipe_parallel_size')}: DeepSpeed's pipeline engine never prints the profile (only "
            f"DeepSpeedEngine.step does); use pipe_parallel_size: 0 to profile, or Deepy's throughput/mfu "
            f"metrics"]


@rule
def fp32_allreduce_is_communication_data_type(ctx: RuleContext) -> list[str]:
    """GPT-NeoX's ``fp32_allreduce`` is handed to DeepSpeed as ``communication_data_type: fp32``."""
    kind = ctx.get("communication_data_type")
    if not ctx.get("fp32_allreduce") or kind in (None, "fp32"):
        return []
    return [f"{ctx.show('fp32_allreduce')} and {ctx.show('communication_data_type')} disagree: fp32_allreduce "
            f"means communication_data_type fp32; keep one"]


@rule
def torch_checkpoint_has_no_deepspeed_options(ctx: RuleContext) -> list[str]:
    """``deepspeed_activation_checkpointing: false`` recomputes under torch's checkpoint, which has none of DeepSpeed's
    options (partitioning over tp, CPU offload, contiguous buffers, per-layer synchronisation, profiling)."""
    if not _checkpointing_on(ctx) or ctx.get("deepspeed_activation_checkpointing"):
        return []
    options = [ctx.show(key) for key in CHECKPOINT_OPTION_KEYS if ctx.get(key)]
    block = ctx.get("activation_checkpointing")
    if isinstance(block, Mapping):
        where = describe(ctx.source("activation_checkpointing"))
        options += [f"activation_checkpointing.{key}={value} ({where})" for key, value in block.items()
                    if value and key != "number_checkpoints"]
    if not options:
        return []
    return [f"{ctx.show('deepspeed_activation_checkpointing')} recomputes with torch's checkpoint, which has none of "
            f"DeepSpeed's checkpointing options: {', '.join(options)}. Set deepspeed_activation_checkpointing: true, "
            f"or remove them"]
