"""The run's opening and closing lines on the speaking rank: what is trained how (:func:`say_header`, after the
checkpoint load) and what came of it (:func:`say_summary`); ``megatron/logging/run_summary.py`` words them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.data.batch import BatchLayout
from megatron.data.build import DataSplits
from megatron.engine.build import Engine
from megatron.engine.config import compute_dtype
from megatron.logging.monitor import Monitor
from megatron.logging.run_summary import RunFacts, RunOutcome, header_lines, split_size, summary_lines
from megatron.model import num_parameters
from megatron.training.loop import LoopContext, TrainState
from megatron.training.train_config import TrainConfig


def say_header(monitor: Monitor, run: TrainConfig, eng: Engine, batch: BatchLayout, splits: DataSplits,
               state: TrainState, train_iters: int, zero_stage: int, metrics_dir: str | None, save: str | None) -> None:
    """The run's opening lines: its name, the model, the layout, the batch, how far it goes and where it writes."""
    training, model_config, objective = run.training, eng.config, eng.objective
    seq = training.seq_length
    trainable = adapter_parameters(eng.engine.module) if run.lora.lora_enabled else num_parameters(model_config)
    split_tokens, split_documents = split_size(splits.train)
    # what the run will have read after its last step: what it read before this launch (at the batch it had
    # then; a checkpoint GPT-NeoX wrote counts samples only) and the batches of the steps to go
    per_sample = seq * objective.rows_per_sample
    batches = training.batch.schedule(batch.dp)
    ahead = batches.offset_at(train_iters) - batches.offset_at(state.iteration) if train_iters > state.iteration else 0
    for line in header_lines(RunFacts(
            run_name=state.run_name or "", metrics_dir=metrics_dir, parameters=num_parameters(model_config),
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
            eval_iters=training.loop.eval_iters, save=save)):
        monitor.message(line)


def say_summary(monitor: Monitor, ctx: LoopContext, state: TrainState, first: int, tokens: int, save: str | None,
                metrics_dir: str | None) -> None:
    """The run's closing lines (speaking rank): steps, time, tokens, speed, last losses, where things are."""
    for line in summary_lines(RunOutcome(
            first_iteration=first, last_iteration=state.iteration, stop_reason=state.stop_reason or "stopped",
            wall_seconds=monitor.elapsed(), tokens=tokens, world_size=ctx.world_size,
            flops_per_token=ctx.flops_per_token, peak_tflops=ctx.peak_tflops, last_row=monitor.last,
            save=save, metrics_file=os.path.join(metrics_dir, "metrics.jsonl") if metrics_dir else None)):
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
