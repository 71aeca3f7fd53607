"""``RunConfig``: the resolved arguments of a training run as a tree of the components' own groups.

``train.py`` reads the resolved config file, calls :meth:`RunConfig.from_resolved` and hands each component its
own part (``run.model``, ``run.data``, ...). Each part is an instance of the group its component declares beside
itself (``GPTConfig`` in ``megatron/model/config.py``, ``LoggingArgs`` in ``megatron/logging/config.py``, ...)
holding that group's keys and nothing else (:func:`group`), or a frozen object declared beside the component
holding its group and the values of keys other components own, resolved here once (``DataRun``,
``TrainingRun``, ``EngineRun``, ``ParallelRun``). The flat object of every key (``NeoXArgs``, GPT-NeoX's
spelling) stays here and in the app: no component receives it (``tests/unit/test_run_config_tree.py``).

The honesty test (``tests/unit/test_config_honesty.py``) checks that every supported key is read by a
component (or a group's own methods), the DeepSpeed split or the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.checkpointing.config import CheckpointArgs
from megatron.data.batch import RankBatch, eval_batch_size
from megatron.data.batch_schedule import schedule_pairs
from megatron.data.config import DataArgs, DataRun
from megatron.evaluation.config import EvalRun
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.mpu.parallel_config import ParallelRun
from megatron.tokenizer.config import TokenizerArgs
from megatron.errors import ConfigError
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.engine.config import EngineArgs, EngineRun
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.hang_config import HangArgs
from megatron.training.stragglers import StragglerArgs
from megatron.training.weight_server_config import WeightServerArgs
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.curriculum import CurriculumArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.config import TrainingLoopArgs, TrainingRun
from megatron.training.train_config import TrainConfig
from megatron.engine.lr_config import LRSchedulerArgs
from megatron.objectives.config import ObjectiveArgs
from megatron.engine.optimizer_config import OptimizerArgs

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.component_groups import evaluation_run, group
from megatron.neox_arguments.deepspeed_split import deepspeed_config as split_deepspeed
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.loading import config_from_mapping

if TYPE_CHECKING:
    from megatron.neox_arguments.resolved import ResolvedConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig(TrainConfig):
    """The root of the run's tree of groups: the trainer's node (:class:`TrainConfig`, which holds the engine's,
    :class:`EngineConfig`) and what only the programs on top read. Each field is the instance a component
    receives (its group's keys only), or a frozen object of a group and the shared values it reads. Built by
    :meth:`from_args`, which refuses arguments deepy.py has not resolved."""

    hang: HangArgs
    """Hang detection's and the collective timeouts' keys (``train.py``'s watch, the process group)."""
    tasks: EvalRun | None = None
    """What lm-eval inside training reads (``eval_tasks``); None without tasks."""

    @classmethod
    def from_args(cls, args: NeoXArgs, deepspeed_config: dict[str, Any] | None = None,
                  args_record: dict[str, Any] | None = None, run_name: str | None = None) -> RunConfig:
        """Each component's part of the resolved ``args``; ``deepspeed_config`` defaults to the split of ``args``,
        ``args_record`` to every key of ``args`` as JSON."""
        if args.seq_length is None or args.train_batch_size is None or args.train_micro_batch_size_per_gpu is None:
            raise ConfigError("seq_length and the batch sizes must be resolved (launch through deepy.py)")
        return cls(
            parallel=parallel_run(args), model=group(args, GPTConfig), tokenizer=group(args, TokenizerArgs),
            engine=engine_run(args), optimizer_config=group(args, OptimizerArgs),
            lr_config=group(args, LRSchedulerArgs), activation_config=group(args, ActivationCheckpointArgs),
            logging=group(args, LoggingArgs), lora=group(args, LoRAArgs), objective=group(args, ObjectiveArgs),
            deepspeed_config=split_deepspeed(args) if deepspeed_config is None else deepspeed_config,
            args_record=args.model_dump(mode="json") if args_record is None else args_record,
            data=data_run(args), training=training_run(args), averaging=group(args, ModelAveragingArgs),
            stragglers=group(args, StragglerArgs), bad_steps=group(args, BadStepArgs),
            weight_server=group(args, WeightServerArgs),
            curriculum=group(args, CurriculumArgs),
            reinit=group(args, ReinitTokensArgs), peft_saves=group(args, PeftSaveArgs),
            hf_saves=group(args, HFSaveArgs), checkpoint=group(args, CheckpointArgs), run_name=run_name,
            hang=group(args, HangArgs), tasks=evaluation_run(args) if args.eval_tasks else None)

    @classmethod
    def from_resolved(cls, resolved: ResolvedConfig) -> RunConfig:
        """What a rank builds from the file deepy.py wrote."""
        return cls.from_args(resolved.args, resolved.deepspeed_config, run_name=resolved.run_name)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], world_size: int = 1) -> RunConfig:
        """Through the real loader and rules, from a Python mapping (tools and tests)."""
        return cls.from_resolved(finalize(config_from_mapping(values), world_size))


def _resolved(value: int | None, key: str) -> int:
    """A key ``RunConfig`` refuses unresolved (or that the derivations always fill in)."""
    if value is None:
        raise ConfigError(f"{key} must be resolved (launch through deepy.py)")
    return value


def data_run(args: NeoXArgs) -> DataRun:
    """The datasets' frozen view: the data keys (its own ``DataArgs``) and the shared values."""
    global_batch = _resolved(args.train_batch_size, "train_batch_size")
    return DataRun(keys=group(args, DataArgs), seq_length=_resolved(args.seq_length, "seq_length"), seed=args.seed,
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
    """The loop's frozen view: its keys (its own ``TrainingLoopArgs``) and the shared values."""
    return TrainingRun(loop=group(args, TrainingLoopArgs), seq_length=_resolved(args.seq_length, "seq_length"), precision=args.precision,
                       seed=args.seed, batch=_rank_batch(args))


def engine_run(args: NeoXArgs) -> EngineRun:
    """The engine's frozen view: its keys (its own ``EngineArgs``) and the shared values."""
    return EngineRun(keys=group(args, EngineArgs), seq_length=_resolved(args.seq_length, "seq_length"), precision=args.precision,
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
