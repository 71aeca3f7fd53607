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

from megatron.errors import ConfigError
from megatron.training.lr_schedules import ScheduleSpec, cycle_starts_for, steps_of

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


@dataclass(frozen=True, kw_only=True, slots=True)
class LRConfig:
    """The LR schedule keys; :meth:`spec` turns them into a :class:`ScheduleSpec` once the number of
    training steps and the peak rate are known."""

    decay_style: str = "linear"
    decay_iters: int | None = None
    decay_fraction_of_training: float | None = None
    """``lr_decay_fraction``: decay over this share of train_iters instead of lr_decay_iters."""
    min_lr: float = 0.0
    min_lr_ratio: float | None = None
    warmup: float = 0.01
    cycles: int | list[int] | None = None
    cycle_length: int | None = None
    rewarmup: float = 0.0
    decay_fraction: float | None = None
    """Share of each cycle spent decaying (wsd cooldown)."""
    override_lr_scheduler: bool = False
    """On resume, use this config's schedule even where the checkpoint's differs."""
    use_checkpoint_lr_scheduler: bool = False
    """On resume, use the checkpoint's schedule even where this config's differs."""

    def spec(self, train_iters: int, max_lr: float) -> ScheduleSpec:
        """GPT-NeoX semantics: ``warmup`` is a fraction of ``lr_decay_iters`` (default train_iters),
        ``min_lr`` an absolute floor; Deepy extras as documented in the schema."""
        total = self.decay_iters or 0
        if not total and self.decay_fraction_of_training is not None:
            total = int(round(self.decay_fraction_of_training * train_iters))
        total = total or train_iters
        if total < 1:
            raise ConfigError("the LR schedule needs lr_decay_iters or train_iters to be set (>= 1)")
        min_lr = max_lr * self.min_lr_ratio if self.min_lr_ratio is not None else self.min_lr
        starts = cycle_starts_for(total, self.cycles, self.cycle_length)
        later_len = (starts[2] - starts[1]) if len(starts) > 2 else (total - starts[-1])
        warmup_steps = steps_of(self.warmup, total)
        return ScheduleSpec(
            style=self.decay_style,
            max_lr=max_lr,
            min_lr=min_lr,
            total_steps=total,
            warmup_steps=warmup_steps,
            rewarmup_steps=steps_of(self.rewarmup, later_len) if len(starts) > 1 else 0,
            cycle_starts=starts,
            decay_fraction=self.decay_fraction,
            # inv/inv_sqrt continue the warmup's slope: lr * sqrt(W / (W + t)) is the classic
            # inverse-square-root schedule when T is the warmup length
            timescale=float(max(warmup_steps, 1)),
        )

    @classmethod
    def from_args(cls, args: NeoXArgs) -> LRConfig:
        return cls(
            decay_style=args.lr_decay_style,
            decay_iters=args.lr_decay_iters,
            decay_fraction_of_training=args.lr_decay_fraction,
            min_lr=args.min_lr,
            min_lr_ratio=args.min_lr_ratio,
            warmup=args.warmup,
            cycles=args.cycles,
            cycle_length=args.cycle_length,
            rewarmup=args.rewarmup,
            decay_fraction=args.decay_fraction,
            override_lr_scheduler=args.override_lr_scheduler,
            use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
        )


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
