"""``pretrain(run)``: tokenizer -> datasets -> engine -> (load) -> loop -> (save).

Runs on every rank after ``megatron.initialize.initialize`` built the process groups. Every
component gets its own part of the typed :class:`RunConfig`; values only known at start-up (the
padded vocabulary, train_iters derived from train_epochs) are computed here and passed on
explicitly, never written back into a config.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.manager import CheckpointHooks
from megatron.checkpointing.manager import CheckpointManager
from megatron.checkpointing.save_load import BeforeCommit
from megatron.data.build import build_datasets
from megatron.data.config import DataRun
from megatron.data.batch import BatchLayout
from megatron.data.sampler import MicroBatchIterator, prefetched
from megatron.errors import ConfigError
from megatron.logging.console import is_verbose, set_verbose
from megatron.logging.log import get_logger, set_deepspeed_log_level, setup_logging
from megatron.logging.monitor import Monitor, build_monitor
from megatron.logging.progress import progress
from megatron.logging.run_summary import RunFacts, RunOutcome, header_lines, split_size, summary_lines
from megatron.logging.throughput import current_device_name, peak_tflops
from megatron.logging.timers import TimedIterator
from megatron.model import flops_per_token, num_parameters
from megatron.model.flops import hardware_flops_per_token
from megatron.model.pipeline import model_parameter_name
from megatron.mpu.random import model_parallel_manual_seed
from megatron.tokenizer import build_tokenizer
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.stragglers import StragglerArgs, StragglerWatch
from megatron.training.bad_steps import BadStepArgs
from megatron.training.comms_report import CommsReport
from megatron.engine.config import compute_dtype
from megatron.training.config import TrainingLoopArgs, TrainingRun, last_iteration
from megatron.engine.build import build_engine, layers_to_checkpoint, partition_method
from megatron.engine.process import limit_cpu_threads, speaks
from megatron.training.evaluate import maybe_evaluator
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.hf_saves import HFSaves, HFWriterFactory, gathered_parameters, live_weights, save_dtype
from megatron.training.loop import Hooks, LoopContext, TrainState, train
from megatron.training.model_averaging import ModelAverage
from megatron.objectives import build_objective, build_reference
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.reinit_tokens import reinit_tokens
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.peft_saves import PeftSaves
from megatron.training.step_saves import StepSaves
from megatron.engine.run_views import RunViews
from megatron.training.skip_gate import BadStepGate



def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def resolve_train_iters(training: TrainingLoopArgs, train_dataset: object, batch: BatchLayout) -> int:
    """``train_iters``, or (train_epochs) the whole global batches of the epoch-sized train split."""
    if training.train_iters:
        return training.train_iters
    if training.train_epochs and train_dataset is not None:
        return len(train_dataset) // batch.global_size  # type: ignore[arg-type]  # every train split is Sized
    raise ConfigError("set train_iters (or train_epochs) so the run knows when to stop")


class TaskRunner(Protocol):
    def run(self) -> dict[str, float]: ...


class TaskEvaluationBuilder(Protocol):
    """Builds what runs the lm-eval tasks (``eval_tasks``) on the engine's module every ``interval`` steps
    (None: at every evaluation): ``megatron.evaluation.in_training.TasksInTraining``, made by ``train.py`` from
    ``RunConfig.tasks`` (evaluation sits above training: it runs the model through generation's replica)."""

    @property
    def interval(self) -> int | None: ...

    def __call__(self, eng: Any, tokenizer: Any, zero_stage: int, sequence_parallel: bool) -> TaskRunner: ...


class PretrainRun(RunViews, Protocol):
    """The run ``pretrain`` trains: the views the engine reads (:class:`RunViews`), the data keys, and the
    run's record and name. ``RunConfig`` provides them (the argument layer, above training)."""

    @property
    def data(self) -> DataRun: ...
    @property
    def training(self) -> TrainingRun: ...
    @property
    def averaging(self) -> ModelAveragingArgs: ...

    @property
    def stragglers(self) -> StragglerArgs: ...
    @property
    def bad_steps(self) -> BadStepArgs: ...
    @property
    def reinit(self) -> ReinitTokensArgs: ...
    @property
    def peft_saves(self) -> PeftSaveArgs: ...
    @property
    def hf_saves(self) -> HFSaveArgs: ...
    @property
    def args_record(self) -> dict[str, Any]:
        """Every resolved key as JSON (stored in checkpoints to describe the run)."""
        ...
    @property
    def run_name(self) -> str | None:
        """The name deepy.py gave the run; None: the ranks name it."""
        ...


def pretrain(run: PretrainRun, checkpoint: CheckpointArgs, before_commit: BeforeCommit | None = None,
             task_evaluation: TaskEvaluationBuilder | None = None,
             hf_writer: HFWriterFactory | None = None) -> TrainState:
    """Train as ``run`` says, saving and loading as ``checkpoint`` (``RunConfig.checkpoint``) says.
    ``before_commit``: called between writing a checkpoint's files and committing it (the crash-safety tests
    kill the process there); ``task_evaluation``: runs the lm-eval tasks, given when the config names
    ``eval_tasks`` (``train.py`` builds it from ``RunConfig.tasks``); ``hf_writer``: builds the writer of the
    HF saves, given when the config names ``hf_save_path`` (``train.py``: the exporter sits beside training)."""
    limit_cpu_threads()
    training, log_config = run.training, run.logging
    verbose = is_verbose(log_config.deepspeed_log_level)
    set_verbose(verbose)
    setup_logging(speaks(), verbose=verbose)
    log = get_logger()
    set_deepspeed_log_level(log_config.deepspeed_log_level)
    model_parallel_manual_seed(training.seed)
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    padded_vocab = model_config.vocab
    seq = training.seq_length
    splits = build_datasets(run.data, tokenizer, padded_vocab)
    # the batch sizes deepy.py solved, on this run's data-parallel ranks (context-parallel ranks read alike)
    batch = training.batch.on(dp=mpu.get_data_shard_count())
    dp_rank = mpu.get_data_shard_rank()
    train_iters = resolve_train_iters(training.loop, splits.train, batch)
    stop_at = last_iteration(train_iters, splits.train_samples_cap, batch.global_size)
    record = {**run.args_record, "padded_vocab_size": padded_vocab, "train_iters": train_iters}

    # the train_impl's batches and loss; a frozen reference copy takes the starting weights before the
    # run's own checkpoint load (which may move the policy to a later step)
    objective = build_objective(run.objective, eod_token=tokenizer.eod)
    eng = build_engine(run, model_config, train_iters, objective)
    eng.reference = build_reference(objective, eng.engine, eng.is_pipe, eng.config, eng.ds_config,
                                    partition_method(run.parallel.pipe_partition_method) if eng.is_pipe else None,
                                    adapters=run.lora.lora_enabled)
    eng.reference.capture(eng.engine, record, checkpoint)
    model_config = eng.config  # a reward model's scalar head replaces the LM head
    trainable = adapter_parameters(eng.engine.module) if run.lora.lora_enabled else num_parameters(model_config)

    g = batch.global_size
    device = _device()
    # evaluation batches: eval_micro_batch_size_per_gpu per rank with no accumulation, else training's
    eval_batch = batch if training.loop.eval_micro_batch_size_per_gpu is None else BatchLayout(
        micro=training.loop.eval_micro_batch_size_per_gpu, gas=1, dp=batch.dp)

    def validation_loss() -> float:
        """Loss of the first global batch of the train split (fixed, for checkpoint validation)."""
        evaluator = maybe_evaluator(eng, splits.train, 1, batch, dp_rank, device, "train")
        assert evaluator is not None
        return evaluator.evaluate()["lm_loss"]

    manager = CheckpointManager.from_config(checkpoint, args_record=record, train_iters=stop_at,
                                            before_commit=before_commit, new_parameters=eng.objective.new_parameters)
    validate = validation_loss if checkpoint.checkpoint_validation_with_forward_pass else None
    ckpt = CheckpointHooks(manager, validate=validate,
                           reseed=lambda iteration: model_parallel_manual_seed(training.seed + iteration))
    ckpt.attach_model(eng, run.parallel.model_parallel_size)
    averaging = None if run.averaging.ema_beta is None else ModelAverage(
        eng.engine.module, run.averaging.ema_beta, optimizer=eng.engine.optimizer,
        layout={"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipe_parallel_world_size(),
                "pipeline": eng.is_pipe},
        place=f"tp{mpu.get_tensor_model_parallel_rank():02d}_pp{mpu.get_pipe_parallel_rank():02d}",
        writer=mpu.get_data_parallel_rank() == 0)
    if averaging is not None:
        manager.rank_files.append(averaging.save)
    rule = run.bad_steps.bad_step_rule()
    bad_steps = None if rule is None else BadStepGate(eng.engine, rule)
    if bad_steps is not None:
        eng.before_update = bad_steps.set_loss
    zero_stage = int(eng.engine.zero_optimization_stage())  # the engine's (the config's), read once
    # also without `load`: a fresh start refuses a `save` directory that already holds a run
    state = ckpt.load(eng, TrainState())
    # Levanter's sft.py: at step 0 only, after the starting weights are loaded (a resume keeps the run's rows)
    redrawn = reinit_tokens(eng.engine.module, run.reinit, tokenizer, iteration=state.iteration,
                            tied=not model_config.no_weight_tying, seed=training.seed, optimizer=eng.engine.optimizer,
                            partitioned=zero_stage == 3)
    if redrawn and speaks():
        log.info("reinit_tokens: re-drew the rows of %s in %s", ", ".join(run.reinit.reinit_tokens or []),
                 " and ".join(redrawn))
    if averaging is not None and not (manager.resumed_from is not None and averaging.load(manager.resumed_from)):
        averaging.restart()  # the weights this run starts from (loaded ones included) begin the average
    if bad_steps is not None:
        bad_steps.rule.restore(state.bad_steps)

    rank = dist.get_rank() if dist.is_initialized() else 0
    monitor = build_monitor(log_config, wall_clock_breakdown=bool(run.deepspeed_config.get("wall_clock_breakdown")),
                            engine=eng.engine, rank=rank, speaks=speaks(), start_iteration=state.iteration,
                            train_iters=stop_at, wandb_run_id=state.wandb_run_id,
                            run_config=run.args_record, logger=log, cuda=torch.cuda.is_available(),
                            run_name=state.run_name or run.run_name)
    state.wandb_run_id = monitor.wandb_run_id or state.wandb_run_id  # saved with every checkpoint
    state.run_name = monitor.run_name
    metrics_dir = os.path.join(log_config.log_dir, state.run_name) if log_config.log_dir else None
    split_tokens, split_documents = split_size(splits.train)
    # what the run will have read after its last step: what it read before this launch (at the batch it had
    # then; a checkpoint GPT-NeoX wrote counts samples only) and the batches of the steps to go
    per_sample = seq * objective.rows_per_sample
    batches = training.batch.schedule(batch.dp)
    ahead = batches.offset_at(train_iters) - batches.offset_at(state.iteration) if train_iters > state.iteration else 0
    for line in header_lines(RunFacts(
            run_name=state.run_name, metrics_dir=metrics_dir, parameters=num_parameters(model_config),
            non_embedding_parameters=num_parameters(model_config, include_embeddings=False),
            trainable_parameters=trainable, adapters=run.lora.lora_enabled,
            engine="pipeline" if eng.is_pipe else "plain",
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            dp=batch.dp, tp=run.parallel.model_parallel_size, pp=run.parallel.pipe_stages,
            cp=run.parallel.context_parallel_size,
            zero_stage=zero_stage,
            precision=compute_dtype(training.precision), micro_batch=batch.micro, accumulation=batch.gas,
            global_batch=batch.global_size, seq_length=seq,
            rows_per_sample=objective.rows_per_sample,
            tokens_per_step=batch.global_size * seq * objective.rows_per_sample,
            train_iters=train_iters, start_iteration=state.iteration,
            samples_at_end=state.consumed_samples + ahead,
            tokens_at_end=(state.consumed_tokens or state.consumed_samples * per_sample) + ahead * per_sample,
            split_tokens=split_tokens,
            split_documents=split_documents, eval_interval=training.loop.eval_interval if splits.valid is not None else None,
            eval_iters=training.loop.eval_iters, save=checkpoint.save)):
        monitor.message(line)
    if state.consumed_samples:
        log.info("data: resuming at sample %s of the global order (computed from consumed_samples, nothing "
                 "replayed)", f"{state.consumed_samples:,}")
    # Levanter's users watch a bar while a resumed run fast-forwards through its data. Ours is a seek
    # (the iterator computes its position), so the bar over the skipped global batches fills at once
    # and says how long that took; on the speaking rank, to stderr, and only when there is a skip.
    schedule = training.batch.schedule(batch.dp) if training.batch.steps else None
    skipped = state.iteration if schedule is not None else state.consumed_samples // g
    with progress(skipped, "data fast-forward", "global batches", enabled=speaks() and skipped > 0,
                  every_s=float("inf")) as fast_forward:
        source = MicroBatchIterator(eng.reference.wrap_dataset(splits.train, "train"), state.consumed_samples,
                                    batch, dp_rank, schedule)
        fast_forward.update(skipped)
    # read ahead by a background thread (num_workers micro-batches), pinned for asynchronous copies on a
    # GPU; the data timer measures what the step still waits for
    micro = TimedIterator(prefetched(source, training.loop.num_workers), monitor.timers)
    # whole model: FLOPs are per token
    recomputed = len(layers_to_checkpoint(run.activation_config, model_config.arch.layers))
    end_reason = ("train_iters reached" if stop_at == train_iters
                  else f"the data's {training.loop.max_train_epochs} epochs are used up (max_train_epochs)")
    ctx = LoopContext(
        eng=eng, training=training.loop, micro_batches=micro, device=device,
        train_iters=stop_at, global_batch_size=g, tokens_per_step=g * seq * objective.rows_per_sample,
        flops_per_token=flops_per_token(model_config, seq), world_size=dist.get_world_size() if dist.is_initialized() else 1,
        peak_tflops=peak_tflops(current_device_name(), compute_dtype(training.precision),
                                log_config.peak_theoretical_tflops),
        monitor=monitor, hardware_flops_per_token=hardware_flops_per_token(model_config, recomputed, seq),
        valid=maybe_evaluator(eng, splits.valid, training.loop.eval_iters, eval_batch, dp_rank, device, "valid"),
        test=maybe_evaluator(eng, splits.test, training.loop.eval_iters, eval_batch, dp_rank, device, "test"),
        tasks=None if task_evaluation is None else task_evaluation(
            eng, tokenizer, zero_stage=zero_stage,
            sequence_parallel=run.model.sequence_parallel and run.parallel.model_parallel_size > 1).run,
        tasks_interval=None if task_evaluation is None else task_evaluation.interval,
        end_reason=end_reason, averaging=averaging, bad_steps=bad_steps, schedule=schedule,
        stragglers=None if run.stragglers.straggler_factor is None else StragglerWatch(
            run.stragglers.straggler_factor, run.stragglers.straggler_window, rank, metrics_dir, monitor.message),
    )
    # DeepSpeed's communication timings (comms_logger): shown after the last step, and with verbose at log steps
    comms = CommsReport(run.deepspeed_config.get("comms_logger"), log_config.log_interval)
    hooks = Hooks(after_step=[ckpt.after_step, comms.after_step], at_exit=[ckpt.at_exit, comms.at_exit])
    zero3 = zero_stage == 3  # every rank gathers the partitions, rank 0 keeps them
    average = None if averaging is None else lambda: averaging.whole(keep=rank == 0)  # gathered under ZeRO-3
    rename = model_parameter_name if eng.is_pipe else None  # a one-stage pipeline (pp 1): GPTModel's names back
    ema_beta = run.averaging.ema_beta
    step_saves: list[StepSaves] = []
    if run.peft_saves.lora_peft_save_path is not None:  # Levanter's eval_model: the average when there is one
        module = eng.engine.module
        adapters = [p for a in eng.adapters for p in a.parameters()]
        step_saves.append(PeftSaves(
            run.peft_saves, run.lora, model_config, base_model=checkpoint.initialize_from_hf,
            weights=live_weights(module, average, gathered_parameters(adapters) if zero3 else None, keep=rank == 0,
                                 rename=rename),
            writer=rank == 0, agree=mpu.rank0_decides, ema_beta=ema_beta))
    if run.hf_saves.hf_save_path is not None:  # Levanter's hf_save_path: rank 0 writes, the average when there is one
        if hf_writer is None:
            raise ConfigError("hf_save_path: this program was not given the HF writer (train.py gives it)")
        writer = hf_writer(model_config, run.tokenizer, save_dtype(run.hf_saves, training.precision),
                           run.lora.lora_scale if run.lora.lora_enabled else None) if rank == 0 else None
        module = eng.engine.module
        gathered = gathered_parameters(list(module.parameters())) if zero3 else None
        step_saves.append(HFSaves(run.hf_saves, live_weights(module, average, gathered, keep=rank == 0, rename=rename),
                                  writer, agree=mpu.rank0_decides, ema_beta=ema_beta))
    for saves in step_saves:
        hooks.after_step.append(saves.after_step)
        hooks.at_exit.append(saves.at_exit)
    first, first_tokens = state.iteration, state.consumed_tokens
    try:
        for saves in step_saves:  # a save killed while writing (its step's checkpoint committed) is written now
            saves.resume(state.iteration, stop_at)
        state = train(ctx, state, hooks)
        say_summary(monitor, ctx, state, first, state.consumed_tokens - first_tokens, checkpoint.save,
                    os.path.join(metrics_dir, "metrics.jsonl") if metrics_dir else None)
        return state
    finally:
        monitor.close(state.iteration, failed=sys.exc_info()[0] is not None)


def say_summary(monitor: Monitor, ctx: LoopContext, state: TrainState, first: int, tokens: int, save: str | None,
                metrics_file: str | None) -> None:
    """The run's closing lines (speaking rank): steps, time, tokens, speed, last losses, where things are."""
    for line in summary_lines(RunOutcome(
            first_iteration=first, last_iteration=state.iteration, stop_reason=state.stop_reason or "stopped",
            wall_seconds=monitor.elapsed(), tokens=tokens, world_size=ctx.world_size,
            flops_per_token=ctx.flops_per_token, peak_tflops=ctx.peak_tflops, last_row=monitor.last,
            save=save, metrics_file=metrics_file)):
        monitor.message(line)


def adapter_parameters(module: torch.nn.Module) -> int:
    """Parameters a LoRA run trains, over the whole model: this rank's trainable ones at their full
    tensor-parallel size (a split factor times tp), each pipeline stage's counted once by name."""
    tp = mpu.get_tensor_model_parallel_world_size()
    local = {name: int(getattr(p, "ds_numel", p.numel())) * (tp if getattr(p, "tensor_model_parallel", False) else 1)
             for name, p in module.named_parameters() if p.requires_grad}
    if mpu.get_pipe_parallel_world_size() > 1:
        stages: list[dict[str, int] | None] = [None] * mpu.get_pipe_parallel_world_size()
        dist.all_gather_object(stages, local, group=mpu.get_pipe_parallel_group())
        local = {name: n for stage in stages for name, n in (stage or {}).items()}
    return sum(local.values())
