"""``RunConfig``: the resolved arguments of a training run, and each component's typed view of them.

``train.py`` reads the resolved config file, calls :meth:`RunConfig.from_resolved` and hands each
component its own part (``run.model``, ``run.data``, ...). No component sees the flat argument
object typed as such, so what a component can do is exactly what its config type holds; the honesty test
(``tests/unit/test_config_honesty.py``) checks that every supported key is read by a component (or a
group's own methods), the DeepSpeed split or the launcher. Every component's keys are declared beside it,
so a view is the argument object itself, typed as the component's group; a component that also reads keys
other components own gets a frozen object declared beside it (``DataRun``, ``TrainingRun``, ``EngineRun``,
``ParallelRun``) holding its group and those values, resolved here once (``data_run``, ``training_run``,
``engine_run``, ``parallel_run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.checkpointing.config import CheckpointArgs
from megatron.data.batch import RankBatch, eval_batch_size
from megatron.data.batch_schedule import schedule_pairs
from megatron.data.config import DataRun
from megatron.evaluation.config import EvalRun
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRun
from megatron.tokenizer.config import TokenizerArgs
from megatron.errors import ConfigError
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.engine.config import EngineRun
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.hang_config import HangArgs
from megatron.training.stragglers import StragglerArgs
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.config import TrainingRun
from megatron.engine.lr_config import LRSchedulerArgs
from megatron.objectives.config import ObjectiveArgs
from megatron.engine.optimizer_config import OptimizerArgs

from megatron.neox_arguments.arguments import NeoXArgs, evaluation_run

if TYPE_CHECKING:
    from megatron.neox_arguments.resolved import ResolvedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """The resolved arguments of one run and each component's typed view of them.

    Holds no key of its own: a view is the arguments object itself, typed as the component's group, or a
    frozen object of that group and the shared values it reads, so a component's type says what it may
    read. Construction refuses arguments deepy.py has not resolved."""

    args: NeoXArgs
    """The validated, resolved arguments (``resolved.args``)."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config dict deepy.py split off (batch sizes, precision, ZeRO, ...)."""
    args_record: dict[str, Any] = field(default_factory=dict)
    """Every resolved key as JSON (stored in checkpoints to describe the run; never read for settings)."""
    run_name: str | None = None
    """The name deepy.py gave the run (its directory under ``log_dir``); None: the ranks name it."""
    parallel: ParallelRun = field(init=False, repr=False)
    """What splits the run over ranks: the parallel sizes and the rendezvous (:func:`parallel_run`)."""
    data: DataRun = field(init=False, repr=False)
    """What the datasets read: the data keys and the shared ``seq_length``/``seed``/schedule/batch/
    objective values (:func:`data_run`)."""
    training: TrainingRun = field(init=False, repr=False)
    """What the loop reads: its own keys and the shared ``seq_length``/``precision``/``seed``/batch sizes
    (:func:`training_run`)."""
    engine: EngineRun = field(init=False, repr=False)
    """What the engine builder and the memory estimate read besides the groups: the engine's keys and the
    shared ``seq_length``/``precision``/``seed``/batch sizes/``train_iters`` (:func:`engine_run`)."""

    def __post_init__(self) -> None:
        args = self.args
        if args.seq_length is None or args.train_batch_size is None or args.train_micro_batch_size_per_gpu is None:
            raise ConfigError("seq_length and the batch sizes must be resolved (launch through deepy.py)")
        # the values other components declare, resolved once for the components that read them
        object.__setattr__(self, "parallel", parallel_run(args))
        object.__setattr__(self, "data", data_run(args))
        object.__setattr__(self, "training", training_run(args))
        object.__setattr__(self, "engine", engine_run(args))

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
    def hang(self) -> HangArgs:
        """The arguments, as hang detection's and the collective timeouts' keys."""
        return self.args

    @property
    def stragglers(self) -> StragglerArgs:
        """The arguments, as the straggler watch's keys."""
        return self.args

    @property
    def averaging(self) -> ModelAveragingArgs:
        """The arguments, as the weight average's keys (``ema_beta``)."""
        return self.args

    @property
    def reinit(self) -> ReinitTokensArgs:
        """The arguments, as the token re-initialisation's keys (``reinit_tokens``)."""
        return self.args

    @property
    def peft_saves(self) -> PeftSaveArgs:
        """The arguments, as the PEFT adapter saves' keys (``lora_peft_save_path``, ...)."""
        return self.args

    @property
    def hf_saves(self) -> HFSaveArgs:
        """The arguments, as the HF saves' keys (``hf_save_path``, ...)."""
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


def _resolved(value: int | None, key: str) -> int:
    """A key ``RunConfig`` refuses unresolved (or that the derivations always fill in)."""
    if value is None:
        raise ConfigError(f"{key} must be resolved (launch through deepy.py)")
    return value


def data_run(args: NeoXArgs) -> DataRun:
    """The datasets' frozen view: the data keys (``args`` typed as ``DataArgs``) and the shared values."""
    global_batch = _resolved(args.train_batch_size, "train_batch_size")
    return DataRun(keys=args, seq_length=_resolved(args.seq_length, "seq_length"), seed=args.seed,
                   train_batch_size=global_batch, batch_steps=schedule_pairs(args.train_batch_size_schedule),
                   train_iters=args.train_iters, train_epochs=args.train_epochs,
                   max_train_epochs=args.max_train_epochs, eval_iters=args.eval_iters,
                   eval_batch_size=global_batch if args.eval_micro_batch_size_per_gpu is None else eval_batch_size(
                       global_batch, _rank_batch(args), args.eval_micro_batch_size_per_gpu),
                   eval_interval=args.eval_interval, train_impl=args.train_impl, reference_logps=args.reference_logps)


def _rank_batch(args: NeoXArgs) -> RankBatch:
    """The resolved micro batch and accumulation (``derive_batch`` solved them before launch)."""
    return RankBatch(micro=_resolved(args.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu"),
                     gas=args.gradient_accumulation_steps, steps=schedule_pairs(args.train_batch_size_schedule))


def training_run(args: NeoXArgs) -> TrainingRun:
    """The loop's frozen view: its keys (``args`` typed as ``TrainingLoopArgs``) and the shared values."""
    return TrainingRun(loop=args, seq_length=_resolved(args.seq_length, "seq_length"), precision=args.precision,
                       seed=args.seed, batch=_rank_batch(args))


def engine_run(args: NeoXArgs) -> EngineRun:
    """The engine's frozen view: its keys (``args`` typed as ``EngineArgs``) and the shared values."""
    return EngineRun(keys=args, seq_length=_resolved(args.seq_length, "seq_length"), precision=args.precision,
                     seed=args.seed, batch=_rank_batch(args), train_iters=args.train_iters)


def parallel_run(args: NeoXArgs) -> ParallelRun:
    """The ranks' frozen split: the parallelism keys and the expert, model, backend and rendezvous values."""
    return ParallelRun(model_parallel_size=args.model_parallel_size, pipe_parallel_size=args.pipe_parallel_size,
                       pipe_stages=args.pipe_stages, uses_pipeline_module=args.uses_pipeline_module,
                       pipe_partition_method=args.pipe_partition_method,
                       context_parallel_size=args.context_parallel_size, world_size=args.world_size,
                       sharding_group_size=args.sharding_group_size, sequence_parallel=args.sequence_parallel,
                       moe_expert_parallel_size=args.moe_expert_parallel_size,
                       distributed_backend=args.distributed_backend, master_addr=args.master_addr,
                       master_port=args.master_port, deepspeed_slurm=args.deepspeed_slurm)
