"""Activation checkpointing's keys: which blocks recompute their activations in the backward pass,
and DeepSpeed's options for it (GPT-NeoX's flat keys and DeepSpeed's ``activation_checkpointing``
block, two spellings of the same options). GPT-NeoX files the flat keys under ``NeoXArgsTraining`` and
the block under ``NeoXArgsDeepspeedConfig``.

Declared here, beside the code that reads them (``megatron/engine/build.py`` wraps the blocks and
configures ``deepspeed.checkpointing``; the memory estimate counts the recomputed blocks); the one
argument object (``NeoXArgs``) is composed of this class and the trainer hands those functions that
object, typed as this class.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from megatron.config_schema import ArgGroup

# DeepSpeed's ``activation_checkpointing`` block -> the GPT-NeoX flat key with the same meaning. DeepSpeed
# reads the block only when ``deepspeed.checkpointing.configure`` is handed the config, which the trainer
# does not (it passes every option explicitly), so the block is read here as another spelling of the flat
# keys; the rules refuse a block key that disagrees with its flat key, and unknown block keys.
ACTIVATION_BLOCK_KEYS: dict[str, str] = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize_each_layer",
    "profile": "profile_backward",
    "number_checkpoints": "number_checkpoints",
}


class ActivationCheckpointArgs(ArgGroup):
    """Deepy's own group: GPT-NeoX files these keys under ``NeoXArgsTraining`` (the flat keys) and
    ``NeoXArgsDeepspeedConfig`` (the ``activation_checkpointing`` block)."""

    checkpoint_activations: bool = False
    """Recompute block activations in the backward pass instead of storing them."""

    checkpoint_num_layers: int = Field(1, ge=1)
    """Number of consecutive blocks recomputed together when checkpointing activations."""

    deepspeed_activation_checkpointing: bool = True
    """With checkpoint_activations (or selective_checkpointing): recompute the blocks under DeepSpeed's activation
    checkpointing (deepspeed.checkpointing.checkpoint, configured with partition_activations, contiguous_checkpointing,
    checkpoint_in_cpu, synchronize_each_layer, profile_backward; its buffers reset after each evaluation forward, as
    GPT-NeoX does) when true, under torch's torch.utils.checkpoint (none of those options) when false. The
    gradients are the same."""

    contiguous_checkpointing: bool = False
    """Copy checkpointed activations into one contiguous buffer to reduce fragmentation."""

    checkpoint_in_cpu: bool = False
    """Move checkpointed activations to CPU memory."""

    synchronize_each_layer: bool = False
    """Synchronise the device after every block (debugging and timing)."""

    profile_backward: bool = False
    """Time the backward pass separately."""

    partition_activations: bool = False
    """Split checkpointed activations across tensor-parallel ranks."""

    activation_checkpointing: dict[str, Any] | None = None
    """DeepSpeed activation checkpointing block; normally derived from the checkpoint_* keys."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    selective_checkpointing: int | None = Field(None, ge=1)
    """Recompute activations of every k-th block only, trading less memory saving for less
    recompute."""

    @property
    def recomputes_activations(self) -> bool:
        """Some block recomputes its activations (all of them, or every k-th)."""
        return self.checkpoint_activations or self.selective_checkpointing is not None

    def deepspeed_checkpointing_options(self, num_layers: int) -> dict[str, Any]:
        """The keyword arguments of ``deepspeed.checkpointing.configure``: each flat key, turned on
        when either spelling turns it on; ``number_checkpoints`` (the buffers DeepSpeed sizes for
        contiguous checkpointing) only the block sets, one per layer by default."""
        flat: dict[str, Any] = {
            "partition_activations": self.partition_activations,
            "contiguous_checkpointing": self.contiguous_checkpointing,
            "checkpoint_in_cpu": self.checkpoint_in_cpu,
            "synchronize_each_layer": self.synchronize_each_layer,
            "profile_backward": self.profile_backward,
            "number_checkpoints": None,
        }
        for key, value in (self.activation_checkpointing or {}).items():
            name = ACTIVATION_BLOCK_KEYS[key]  # unknown keys were refused before launch
            flat[name] = value if name == "number_checkpoints" else bool(flat[name] or value)
        return {
            "partition_activations": flat["partition_activations"],
            "contiguous_checkpointing": flat["contiguous_checkpointing"],
            "num_checkpoints": flat["number_checkpoints"] or num_layers,
            "checkpoint_in_cpu": flat["checkpoint_in_cpu"],
            "synchronize": flat["synchronize_each_layer"],
            "profile": flat["profile_backward"],
        }
