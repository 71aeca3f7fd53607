"""``RunConfig``: the typed, frozen configs of every component of a training run, built once from
the validated arguments.

``train.py`` reads the resolved config file, calls :meth:`RunConfig.from_resolved` and hands each
component its own part (``run.model``, ``run.data``, ...). No component sees the flat argument
object typed as such, so what a component can do is exactly what its config type holds; the honesty test
(``tests/unit/test_config_honesty.py``) checks that every supported key is read by one of the
builders below (or a group's own methods), the DeepSpeed split or the launcher. A component whose keys
are declared beside it (the loop, the optimizer, the LR schedule, activation checkpointing, the
tokenizer, checkpoints, logging, LoRA, the objective, the model) is handed the argument object itself, typed as its own group (or,
for the loop, the protocol naming what it reads), and reads its keys in its own methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.checkpointing.config import CheckpointArgs
from megatron.data.config import DataRunArgs
from megatron.evaluation.config import EvalRunArgs, checked
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRunArgs
from megatron.tokenizer.config import TokenizerArgs
from megatron.errors import ConfigError
from megatron.training.activation_config import ActivationCheckpointArgs
from megatron.training.config import TrainingRunArgs
from megatron.training.lr_config import LRSchedulerArgs
from megatron.training.objectives.config import ObjectiveArgs
from megatron.training.optimizer_config import OptimizerArgs

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    parallel: ParallelRunArgs
    """The arguments themselves, as the keys that split the run over ranks (not a copy)."""
    model: GPTConfig
    """The arguments themselves, as the architecture's keys (not a copy); sized for the tokenizer with
    ``for_tokenizer`` (a new object: the arguments keep the user's ``padded_vocab_size``)."""
    tokenizer: TokenizerArgs
    """The arguments themselves, as the tokenizer's keys (not a copy)."""
    data: DataRunArgs
    """The arguments themselves, as the keys the datasets read (not a copy): the data keys and the
    shared ``seq_length``/``seed``/schedule/batch/objective keys, declared by their owners."""
    training: TrainingRunArgs
    """The arguments themselves, as the keys the loop reads (not a copy): its own and the shared
    ``seq_length``/``precision``/``seed``/batch sizes, declared by their owners."""
    optimizer: OptimizerArgs
    """The arguments themselves, as the optimizer's keys (not a copy)."""
    lr: LRSchedulerArgs
    """The arguments themselves, as the LR schedule's keys (not a copy)."""
    activation_checkpointing: ActivationCheckpointArgs
    """The arguments themselves, as activation checkpointing's keys (not a copy)."""
    checkpoint: CheckpointArgs
    """The arguments themselves, as the checkpoint keys (not a copy)."""
    logging: LoggingArgs
    """The arguments themselves, as the logging keys (not a copy)."""
    objective: ObjectiveArgs
    """The arguments themselves, as the objective's keys (not a copy): ``train_impl``, the shared keys and
    the selected plug-in's own (DPO/KTO settings), which the arguments object is composed of too."""
    lora: LoRAArgs
    """The arguments themselves, as the adapter keys (``lora_r == 0``: none, every parameter trains)."""
    tasks: EvalRunArgs | None = None
    """lm-eval tasks run at every evaluation inside training (``eval_tasks``); None without them."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config dict deepy.py split off (batch sizes, precision, ZeRO, ...)."""
    args_record: dict[str, Any] = field(default_factory=dict)
    """Every resolved key as JSON (stored in checkpoints to describe the run; never read for settings)."""

    @classmethod
    def from_args(cls, args: NeoXArgs, deepspeed: dict[str, Any] | None = None,
                  args_record: dict[str, Any] | None = None) -> RunConfig:
        if args.seq_length is None or args.train_batch_size is None or args.train_micro_batch_size_per_gpu is None:
            raise ConfigError("seq_length and the batch sizes must be resolved (launch through deepy.py)")
        return cls(
            parallel=args,
            model=args,
            tokenizer=args,
            data=args,
            training=args,
            optimizer=args,
            lr=args,
            activation_checkpointing=args,
            checkpoint=args,
            logging=args,
            objective=args,
            lora=args,
            tasks=checked(args) if args.eval_tasks else None,
            deepspeed=dict(deepspeed or {}),
            args_record=dict(args_record or {}),
        )

    @classmethod
    def from_resolved(cls, resolved: ResolvedConfig) -> RunConfig:
        """What a rank builds from the file deepy.py wrote."""
        from megatron.neox_arguments.deepspeed_split import deepspeed_config

        args = resolved.args
        ds = resolved.deepspeed_config if resolved.deepspeed_config is not None else deepspeed_config(args)
        return cls.from_args(args, deepspeed=ds, args_record=args.model_dump(mode="json"))

    @classmethod
    def from_mapping(cls, values: dict[str, Any], world_size: int = 1) -> RunConfig:
        """Through the real loader and rules, from a Python mapping (tools and tests)."""
        from megatron.neox_arguments.derived import finalize
        from megatron.neox_arguments.loading import config_from_mapping

        return cls.from_resolved(finalize(config_from_mapping(values), world_size))
