"""``RunConfig``: the resolved arguments of a training run, and each component's typed view of them.

``train.py`` reads the resolved config file, calls :meth:`RunConfig.from_resolved` and hands each
component its own part (``run.model``, ``run.data``, ...). No component sees the flat argument
object typed as such, so what a component can do is exactly what its config type holds; the honesty test
(``tests/unit/test_config_honesty.py``) checks that every supported key is read by a component (or a
group's own methods), the DeepSpeed split or the launcher. Every component's keys are declared beside it,
so each view is the argument object itself, typed as the component's group (or a protocol naming what it
reads, when it also reads keys other components own), and the component reads its keys in its own methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.checkpointing.config import CheckpointArgs
from megatron.data.config import DataRunArgs
from megatron.evaluation.config import EvalRun
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRunArgs
from megatron.tokenizer.config import TokenizerArgs
from megatron.errors import ConfigError
from megatron.training.activation_config import ActivationCheckpointArgs
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.config import TrainingRunArgs
from megatron.training.lr_config import LRSchedulerArgs
from megatron.training.objectives.config import ObjectiveArgs
from megatron.training.optimizer_config import OptimizerArgs

from megatron.neox_arguments.arguments import NeoXArgs, evaluation_run

if TYPE_CHECKING:
    from megatron.neox_arguments.resolved import ResolvedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """The resolved arguments of one run and each component's typed view of them.

    Holds no key of its own: every view below is the arguments object itself, typed as the group (or
    protocol) of what that component reads, so a component's type says what it may read and nothing is
    copied. Construction refuses arguments deepy.py has not resolved."""

    args: NeoXArgs
    """The validated, resolved arguments (``resolved.args``)."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config dict deepy.py split off (batch sizes, precision, ZeRO, ...)."""
    args_record: dict[str, Any] = field(default_factory=dict)
    """Every resolved key as JSON (stored in checkpoints to describe the run; never read for settings)."""
    run_name: str | None = None
    """The name deepy.py gave the run (its directory under ``log_dir``); None: the ranks name it."""

    def __post_init__(self) -> None:
        args = self.args
        if args.seq_length is None or args.train_batch_size is None or args.train_micro_batch_size_per_gpu is None:
            raise ConfigError("seq_length and the batch sizes must be resolved (launch through deepy.py)")

    @property
    def parallel(self) -> ParallelRunArgs:
        """The arguments, as the keys that split the run over ranks."""
        return self.args

    @property
    def model(self) -> GPTConfig:
        """The arguments, as the architecture's keys; sized for the tokenizer with ``for_tokenizer`` (a new object: the
        arguments keep the user's ``padded_vocab_size``)."""
        return self.args

    @property
    def tokenizer(self) -> TokenizerArgs:
        """The arguments, as the tokenizer's keys."""
        return self.args

    @property
    def data(self) -> DataRunArgs:
        """The arguments, as the keys the datasets read: the data keys and the shared
        ``seq_length``/``seed``/schedule/batch/objective keys, declared by their owners."""
        return self.args

    @property
    def training(self) -> TrainingRunArgs:
        """The arguments, as the keys the loop reads: its own and the shared
        ``seq_length``/``precision``/``seed``/batch sizes, declared by their owners."""
        return self.args

    @property
    def optimizer_config(self) -> OptimizerArgs:
        """The arguments, as the optimizer's keys."""
        return self.args

    @property
    def lr_config(self) -> LRSchedulerArgs:
        """The arguments, as the LR schedule's keys."""
        return self.args

    @property
    def activation_config(self) -> ActivationCheckpointArgs:
        """The arguments, as activation checkpointing's keys."""
        return self.args

    @property
    def averaging(self) -> ModelAveragingArgs:
        """The arguments, as the weight average's keys (``ema_beta``)."""
        return self.args

    @property
    def bad_steps(self) -> BadStepArgs:
        """The arguments, as the bad-step rule's keys (``skip_bad_steps_window``, ``_sigma``)."""
        return self.args

    @property
    def checkpoint(self) -> CheckpointArgs:
        """The arguments, as the checkpoint keys."""
        return self.args

    @property
    def logging(self) -> LoggingArgs:
        """The arguments, as the logging keys."""
        return self.args

    @property
    def objective(self) -> ObjectiveArgs:
        """The arguments, as the objective's keys: ``train_impl``, the shared keys and the selected
        plug-in's own (DPO/KTO settings), which the arguments object is composed of too."""
        return self.args

    @property
    def lora(self) -> LoRAArgs:
        """The arguments, as the adapter keys (``lora_r == 0``: none, every parameter trains)."""
        return self.args

    @property
    def tasks(self) -> EvalRun | None:
        """The arguments as lm-eval in training reads them (``eval_tasks``); None without tasks."""
        return evaluation_run(self.args) if self.args.eval_tasks else None

    @classmethod
    def from_resolved(cls, resolved: ResolvedConfig) -> RunConfig:
        """What a rank builds from the file deepy.py wrote."""
        from megatron.neox_arguments.deepspeed_split import deepspeed_config

        args = resolved.args
        ds = resolved.deepspeed_config if resolved.deepspeed_config is not None else deepspeed_config(args)
        return cls(args=args, deepspeed_config=ds, args_record=args.model_dump(mode="json"),
                   run_name=resolved.run_name)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], world_size: int = 1) -> RunConfig:
        """Through the real loader and rules, from a Python mapping (tools and tests)."""
        from megatron.neox_arguments.derived import finalize
        from megatron.neox_arguments.loading import config_from_mapping

        return cls.from_resolved(finalize(config_from_mapping(values), world_size))

