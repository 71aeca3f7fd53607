"""Typed views of the training keys: the loop, the optimizer, the LR schedule and how blocks run
(activation checkpointing, compilation).

Each is frozen and built once from the validated arguments by ``from_args``; the trainer's
components receive these objects and never the flat argument object. Defaults live in the schema
(``megatron/neox_arguments/groups``), so the dataclass defaults here only serve tests that build a
config directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron import plugins
from megatron.errors import ConfigError

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

_PRECISION = {"bfloat16": "bf16", "fp16": "fp16", "fp32": "fp32", None: "fp32"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """What the loop needs: length, batch arithmetic and evaluation cadence (logging has its own
    ``megatron.logging.config.LoggingConfig``)."""

    train_iters: int | None = None
    """None with train_epochs: derived from the data at start-up (see ``pretrain``)."""
    train_epochs: int | None = None
    seq_length: int
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int = 1
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    max_consecutive_overflows: int = 50
    precision: str = "fp32"
    """fp32 | bf16 | fp16: the compute dtype (for the device's peak TFLOP/s)."""
    compile_layers: bool = False
    zero_init: bool = False
    """Construct the model under deepspeed.zero.Init (partitioned as it is built)."""
    seed: int = 1234
    num_workers: int = 2
    """Training micro-batches read ahead of the step by a background thread (0 = none)."""

    @classmethod
    def from_args(cls, args: NeoXArgs) -> TrainingConfig:
        if args.seq_length is None or args.train_batch_size is None or args.train_micro_batch_size_per_gpu is None:
            raise ConfigError("seq_length and the batch sizes must be resolved (launch through deepy.py)")
        return cls(
            train_iters=args.train_iters,
            train_epochs=args.train_epochs,
            seq_length=args.seq_length,
            train_batch_size=args.train_batch_size,
            micro_batch_size=args.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            eval_interval=args.eval_interval,
            eval_iters=args.eval_iters,
            exit_interval=args.exit_interval,
            max_consecutive_overflows=args.max_consecutive_overflows,
            precision=_PRECISION[args.precision],
            compile_layers=args.compile_layers,
            zero_init=args.zero_init,
            seed=args.seed,
            num_workers=args.num_workers,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer block after validation: which builder, its peak rate and its own parameters."""

    kind: str
    """Registry key in ``megatron.training.optimizers.OPTIMIZERS`` (``adam``, ``sgd``, ...)."""
    type: str
    """The type as the user wrote it (for messages)."""
    lr: float
    weight_decay: float
    params: Mapping[str, Any] = field(default_factory=dict)
    """Type-specific parameters (betas, eps, momentum, ...), validated by the schema."""

    @classmethod
    def from_args(cls, args: NeoXArgs) -> OptimizerConfig:
        from megatron.neox_arguments.groups.optimizer_block import OPTIMIZER_KINDS, PARAMS_OF_KIND

        block = args.optimizer
        if block is None:
            # the flat GPT-NeoX alternative to the block: the type's own defaults (GPT-NeoX's) fill
            # every parameter, as an empty block of that type would
            kind, shown, block_lr, block_wd = OPTIMIZER_KINDS[args.optimizer_type], args.optimizer_type, None, None
            params = PARAMS_OF_KIND[kind]().model_dump(exclude={"lr", "weight_decay", "max_grad_norm"})
        else:
            # max_grad_norm is gradient_clipping in apex's spelling: DeepSpeed clips, not the optimizer
            params = block.params.model_dump(exclude={"lr", "weight_decay", "max_grad_norm"})
            kind, shown, block_lr, block_wd = block.kind, block.type, block.params.lr, block.params.weight_decay
        lr = args.lr if args.lr is not None else block_lr
        if lr is None:
            raise ConfigError("no learning rate: set optimizer.params.lr (or lr)")
        weight_decay = block_wd if block_wd is not None else args.weight_decay
        return cls(kind=kind, type=shown, lr=lr, weight_decay=weight_decay, params=params)


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


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointConfig:
    """Which blocks recompute their activations in the backward pass, and DeepSpeed's options for it."""

    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    selective_checkpointing: int | None = None
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    checkpoint_in_cpu: bool = False
    synchronize_each_layer: bool = False
    profile_backward: bool = False
    number_checkpoints: int | None = None
    """``activation_checkpointing.number_checkpoints``: buffers DeepSpeed sizes for contiguous
    checkpointing (default: one per layer)."""

    @property
    def enabled(self) -> bool:
        return self.checkpoint_activations or self.selective_checkpointing is not None

    @classmethod
    def from_args(cls, args: NeoXArgs) -> ActivationCheckpointConfig:
        block: Mapping[str, Any] = args.activation_checkpointing or {}
        flat = {
            "partition_activations": args.partition_activations,
            "contiguous_checkpointing": args.contiguous_checkpointing,
            "checkpoint_in_cpu": args.checkpoint_in_cpu,
            "synchronize_each_layer": args.synchronize_each_layer,
            "profile_backward": args.profile_backward,
            "number_checkpoints": None,
        }
        for key, value in block.items():
            field_name = ACTIVATION_BLOCK_KEYS[key]  # unknown keys were refused before launch
            flat[field_name] = value if field_name == "number_checkpoints" else bool(flat[field_name] or value)
        return cls(
            checkpoint_activations=args.checkpoint_activations,
            checkpoint_num_layers=args.checkpoint_num_layers,
            selective_checkpointing=args.selective_checkpointing,
            **flat,
        )
