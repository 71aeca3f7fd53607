"""``pretrain(run)``: tokenizer -> datasets -> engine -> (load) -> the features' hooks -> loop -> summary.

Runs on every rank after ``megatron.initialize.initialize`` built the process groups. Every
component gets its own part of the typed :class:`RunConfig`; values only known at start-up (the
padded vocabulary, train_iters derived from train_epochs) are computed here and passed on
explicitly, never written back into a config. The features (the EMA, extra saves, lm-eval tasks, ...)
plug into the loop through their hooks (``megatron/training/features/``); ``pretrain`` names none.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.manager import CheckpointHooks, CheckpointManager
from megatron.checkpointing.save_load import BeforeCommit
from megatron.data.batch import BatchLayout
from megatron.data.batch_schedule import BatchSchedule
from megatron.data.build import DataSplits, build_datasets
from megatron.data.sampler import MicroBatchIterator, prefetched
from megatron.engine.build import Engine, build_engine, layers_to_checkpoint, partition_method
from megatron.engine.config import compute_dtype
from megatron.engine.process import limit_cpu_threads, speaks
from megatron.errors import ConfigError
from megatron.logging.console import is_verbose, set_verbose
from megatron.logging.log import get_logger, set_deepspeed_log_level, setup_logging
from megatron.logging.monitor import Monitor, build_monitor
from megatron.logging.progress import progress
from megatron.logging.throughput import current_device_name, peak_tflops
from megatron.logging.timers import TimedIterator
from megatron.model import GPTConfig, flops_per_token
from megatron.model.flops import hardware_flops_per_token
from megatron.model.soft_prompt_settings import PROMPT_NAME, SoftPromptSettings
from megatron.mpu.random import model_parallel_manual_seed
from megatron.objectives import build_objective, build_reference
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.base import Tokenizer
from megatron.training.config import TrainingLoopArgs, last_iteration
from megatron.training.evaluate import maybe_evaluator
from megatron.training.curriculum import build_curriculum
from megatron.training.features import build_hooks
from megatron.training.features.base import Setup
from megatron.training.features.stream_state import restore_stream
from megatron.training.hf_saves import HFWriterFactory
from megatron.training import mup_actions
from megatron.training.loop import LoopContext, TrainState, train
from megatron.training.train_config import TrainConfig, TaskEvaluationBuilder
from megatron.training.run_report import say_header, say_summary


def pretrain(run: TrainConfig, checkpoint: CheckpointArgs, before_commit: BeforeCommit | None = None,
             task_evaluation: TaskEvaluationBuilder | None = None,
             hf_writer: HFWriterFactory | None = None) -> TrainState:
    """Train as ``run`` says, saving and loading as ``checkpoint`` (``RunConfig.checkpoint``) says.
    ``before_commit``: called between writing a checkpoint's files and committing it (the crash-safety tests
    kill the process there); ``task_evaluation``: runs the lm-eval tasks, given when the config names
    ``eval_tasks`` (``train.py`` builds it from ``RunConfig.tasks``); ``hf_writer``: builds the writer of the
    HF saves, given when the config names ``hf_save_path`` (``train.py``: the exporter sits beside training)."""
    log = set_up_rank(run)
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    splits = build_datasets(run.data, tokenizer, model_config.vocab)
    # the batch sizes deepy.py solved, on this run's data-parallel ranks (context-parallel ranks read alike)
    batch = run.training.batch.on(dp=mpu.get_data_shard_count())
    if mup_actions.wanted(model_config):  # save_base_shapes / coord_check: write, then stop as GPT-NeoX does
        log.info(mup_actions.mup_action(run, model_config, splits.train, batch.micro, tokenizer.eod, _device()))
        return TrainState()
    train_iters = resolve_train_iters(run.training.loop, splits.train, batch)
    stop_at = last_iteration(train_iters, splits.train_samples_cap, batch.global_size)
    record = {**run.args_record, "padded_vocab_size": model_config.vocab, "train_iters": train_iters}
    eng = build_training_engine(run, model_config, train_iters, tokenizer, record, checkpoint)
    ckpt = open_checkpoints(run, checkpoint, eng, record, stop_at, before_commit, validation_loss(eng, splits, batch))
    zero_stage = int(eng.engine.zero_optimization_stage())  # the engine's (the config's), read once
    # also without `load`: a fresh start refuses a `save` directory that already holds a run
    state = ckpt.load(eng, TrainState())
    restore_stream(splits.train, state, batch, mpu.get_data_shard_rank())  # streaming: before the first sample
    monitor = start_monitor(run, eng, state, stop_at, log)
    metrics_dir = os.path.join(run.logging.log_dir, monitor.run_name or "") if run.logging.log_dir else None
    first, first_tokens = state.iteration, state.consumed_tokens
    try:
        say_header(monitor, run, eng, batch, splits, state, train_iters, zero_stage, metrics_dir, checkpoint.save)
        hooks = build_hooks(run, Setup(
            eng=eng, tokenizer=tokenizer, checkpoint_keys=checkpoint, checkpoints=ckpt, zero_stage=zero_stage,
            train_iters=stop_at, say=monitor.message, metrics_dir=metrics_dir, task_evaluation=task_evaluation,
            hf_writer=hf_writer, train_data=splits.train))
        ctx = loop_context(run, eng, monitor, splits, batch, state, train_iters, stop_at, tokenizer)
        state = train(ctx, state, hooks)
        say_summary(monitor, ctx, state, first, state.consumed_tokens - first_tokens, checkpoint.save, metrics_dir)
        return state
    finally:
        monitor.close(state.iteration, failed=sys.exc_info()[0] is not None)


def set_up_rank(run: TrainConfig) -> logging.Logger:
    """This rank's share of the CPU cores, its logging (rank 0 speaks) and its random streams; the run's logger."""
    limit_cpu_threads()
    verbose = is_verbose(run.logging.deepspeed_log_level)
    set_verbose(verbose)
    setup_logging(speaks(), verbose=verbose)
    set_deepspeed_log_level(run.logging.deepspeed_log_level)
    model_parallel_manual_seed(run.training.seed)
    return get_logger()


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def resolve_train_iters(training: TrainingLoopArgs, train_dataset: object, batch: BatchLayout) -> int:
    """``train_iters``, or (train_epochs) the whole global batches of the epoch-sized train split."""
    if training.train_iters:
        return training.train_iters
    if training.train_epochs and train_dataset is not None:
        return len(train_dataset) // batch.global_size  # type: ignore[arg-type]  # every train split is Sized
    raise ConfigError("set train_iters (or train_epochs) so the run knows when to stop")


def build_training_engine(run: TrainConfig, model_config: GPTConfig, train_iters: int, tokenizer: Tokenizer,
                          record: dict[str, object], checkpoint: CheckpointArgs) -> Engine:
    """The engine with the ``train_impl``'s batches and loss; a frozen reference copy takes the starting weights
    before the run's own checkpoint load (which may move the policy to a later step). ``eng.config``: the model,
    a reward model's scalar head in place of the LM head."""
    objective = build_objective(run.objective, eod_token=tokenizer.eod)
    prompt = SoftPromptSettings.of(model_config.soft_prompt_tuning)
    prompt_ids = tokenizer.tokenize(prompt.init_string) if prompt is not None and prompt.init_string else []
    eng = build_engine(run, model_config, train_iters, objective, prompt_init_ids=prompt_ids)
    eng.reference = build_reference(objective, eng.engine, eng.is_pipe, eng.config, eng.ds_config,
                                    partition_method(run.parallel.pipe_partition_method) if eng.is_pipe else None,
                                    adapters=run.lora.lora_enabled)
    eng.reference.capture(eng.engine, record, checkpoint)
    return eng


def validation_loss(eng: Engine, splits: DataSplits, batch: BatchLayout) -> Callable[[], float]:
    """The loss of the first global batch of the train split (fixed, for checkpoint validation)."""
    def loss() -> float:
        evaluator = maybe_evaluator(eng, splits.train, 1, batch, mpu.get_data_shard_rank(), _device(), "train")
        assert evaluator is not None
        return evaluator.evaluate()["lm_loss"]
    return loss


def open_checkpoints(run: TrainConfig, checkpoint: CheckpointArgs, eng: Engine, record: dict[str, object],
                     stop_at: int, before_commit: BeforeCommit | None, validate: Callable[[], float]) -> CheckpointHooks:
    """The run's checkpoints: what loads the starting one and saves the steps (``checkpoint``'s keys); ``validate``
    runs after each save with ``checkpoint_validation_with_forward_pass``."""
    # a soft prompt is new to the language-model checkpoint it starts from (initialize_from / finetune)
    prompted = SoftPromptSettings.of(eng.config.soft_prompt_tuning) is not None
    new = eng.objective.new_parameters + ((f"{PROMPT_NAME}.",) if prompted else ())
    manager = CheckpointManager.from_config(checkpoint, args_record=record, train_iters=stop_at,
                                            before_commit=before_commit, new_parameters=new)
    ckpt = CheckpointHooks(manager, validate=validate if checkpoint.checkpoint_validation_with_forward_pass else None,
                           reseed=lambda iteration: model_parallel_manual_seed(run.training.seed + iteration))
    ckpt.attach_model(eng, run.parallel.model_parallel_size)
    return ckpt


def start_monitor(run: TrainConfig, eng: Engine, state: TrainState, stop_at: int, log: logging.Logger) -> Monitor:
    """What the loop logs through; the run's name and W&B run (a resumed run's, else new ones) go into ``state``,
    saved with every checkpoint."""
    monitor = build_monitor(run.logging, wall_clock_breakdown=bool(run.deepspeed_config.get("wall_clock_breakdown")),
                            engine=eng.engine, rank=dist.get_rank() if dist.is_initialized() else 0, speaks=speaks(),
                            start_iteration=state.iteration, train_iters=stop_at, wandb_run_id=state.wandb_run_id,
                            run_config=run.args_record, logger=log, cuda=torch.cuda.is_available(),
                            run_name=state.run_name or run.run_name)
    state.wandb_run_id = monitor.wandb_run_id or state.wandb_run_id
    state.run_name = monitor.run_name
    return monitor


def train_batches(run: TrainConfig, eng: Engine, splits: DataSplits, batch: BatchLayout, state: TrainState,
                  monitor: Monitor, schedule: BatchSchedule | None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches from ``state.consumed_samples`` on, read ahead by a background thread."""
    if state.consumed_samples:
        get_logger().info("data: resuming at sample %s of the global order (computed from consumed_samples, "
                          "nothing replayed)", f"{state.consumed_samples:,}")
    # Levanter's users watch a bar while a resumed run fast-forwards through its data. Ours is a seek
    # (the iterator computes its position), so the bar over the skipped global batches fills at once
    # and says how long that took; on the speaking rank, to stderr, and only when there is a skip.
    skipped = state.iteration if schedule is not None else state.consumed_samples // batch.global_size
    with progress(skipped, "data fast-forward", "global batches", enabled=speaks() and skipped > 0,
                  every_s=float("inf")) as fast_forward:
        source = MicroBatchIterator(eng.reference.wrap_dataset(splits.train, "train"), state.consumed_samples,
                                    batch, mpu.get_data_shard_rank(), schedule)
        fast_forward.update(skipped)
    # read ahead by a background thread (num_workers micro-batches), pinned for asynchronous copies on a
    # GPU; the data timer measures what the step still waits for
    return TimedIterator(prefetched(source, run.training.loop.num_workers), monitor.timers)


def loop_context(run: TrainConfig, eng: Engine, monitor: Monitor, splits: DataSplits, batch: BatchLayout,
                 state: TrainState, train_iters: int, stop_at: int, tokenizer: Tokenizer) -> LoopContext:
    """What the loop reads: the engine, the train batches, the evaluators (counting characters with the
    tokenizer for ``char_level_ppl``), the step's size and FLOPs."""
    training, model_config, device, dp_rank = run.training, eng.config, _device(), mpu.get_data_shard_rank()
    seq, g, rows = training.seq_length, batch.global_size, eng.objective.rows_per_sample
    schedule = training.batch.schedule(batch.dp) if training.batch.steps else None
    micro = train_batches(run, eng, splits, batch, state, monitor, schedule)
    detokenize = tokenizer.detokenize if training.loop.char_level_ppl else None
    # evaluation batches: eval_micro_batch_size_per_gpu per rank with no accumulation, else training's
    eval_batch = batch if training.loop.eval_micro_batch_size_per_gpu is None else BatchLayout(
        micro=training.loop.eval_micro_batch_size_per_gpu, gas=1, dp=batch.dp)
    # whole model: FLOPs are per token
    recomputed = len(layers_to_checkpoint(run.activation_config, model_config.arch.layers))
    end_reason = ("train_iters reached" if stop_at == train_iters
                  else f"the data's {training.loop.max_train_epochs} epochs are used up (max_train_epochs)")
    return LoopContext(
        eng=eng, training=training.loop, micro_batches=micro, device=device,
        train_iters=stop_at, global_batch_size=g, tokens_per_step=g * seq * rows,
        flops_per_token=flops_per_token(model_config, seq), world_size=dist.get_world_size() if dist.is_initialized() else 1,
        peak_tflops=peak_tflops(current_device_name(), compute_dtype(training.precision),
                                run.logging.peak_theoretical_tflops),
        monitor=monitor, hardware_flops_per_token=hardware_flops_per_token(model_config, recomputed, seq),
        valid=maybe_evaluator(eng, splits.valid, training.loop.eval_iters, eval_batch, dp_rank, device, "valid",
                              detokenize),
        test=maybe_evaluator(eng, splits.test, training.loop.eval_iters, eval_batch, dp_rank, device, "test",
                             detokenize),
        end_reason=end_reason, schedule=schedule,
        curriculum=build_curriculum(run.curriculum, seq, completed_steps=state.iteration),
    )
