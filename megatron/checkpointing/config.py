"""The typed view of the checkpoint keys: where to save and load, when to save, what to keep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    load_checkpoint: bool = True
    """False: start fresh even when ``load`` is set (its contents are not looked at)."""
    checkpoint_factor: int | float | None = None
    checkpoint_scale: str = "linear"
    extra_save_iters: list[int] | None = None
    keep_last_n_checkpoints: int | None = None
    save_interval: int | str | None = None
    """Seconds (deepy.py turns phrases such as ``15min`` into seconds)."""
    keep: list[dict[str, int | None]] | None = None
    finetune: bool = False
    initialize_from: str | None = None
    iteration: int | None = None
    """Load this step instead of the latest committed one (GPT-NeoX's ``iteration``)."""
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_rng: bool = False
    validate_with_forward_pass: bool = False
    """``checkpoint_validation_with_forward_pass``: after each save, reload the weights just written
    and require the same loss on a fixed batch."""
    train_iters: int | None = None
    """The last step, which retention always keeps; None until derived from train_epochs."""
    config_files: dict[str, str] = field(default_factory=dict)
    """The run's config files (name -> text), stored with every checkpoint."""

    @classmethod
    def from_args(cls, args: NeoXArgs) -> CheckpointConfig:
        return cls(
            save=args.save,
            load=args.load,
            load_checkpoint=args.load_checkpoint,
            checkpoint_factor=args.checkpoint_factor,
            checkpoint_scale=args.checkpoint_scale,
            extra_save_iters=args.extra_save_iters,
            keep_last_n_checkpoints=args.keep_last_n_checkpoints,
            save_interval=args.save_interval,
            keep=args.keep,
            finetune=args.finetune,
            initialize_from=args.initialize_from,
            iteration=args.iteration,
            no_load_optim=args.no_load_optim,
            no_load_rng=args.no_load_rng,
            no_save_rng=args.no_save_rng,
            validate_with_forward_pass=args.checkpoint_validation_with_forward_pass,
            train_iters=args.train_iters,
            config_files=dict(args.config_files or {}),
        )
