"""``pretrain(args)``: tokenizer -> datasets -> engine -> (load) -> loop -> (save).

Runs on every rank after ``megatron.initialize.initialize(args)`` built the process groups.
Checkpointing is optional here: when ``megatron.checkpointing`` provides ``load`` and
``maybe_save`` they are wired as the load step and the per-step hook.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.data.build import build_datasets
from megatron.data.sampler import MicroBatchIterator, prefetched
from megatron.errors import ConfigError
from megatron.logging.log import get_logger, setup_logging
from megatron.logging.metrics import MetricsWriter
from megatron.logging.throughput import current_device_name, peak_tflops
from megatron.model import flops_per_token, num_parameters
from megatron.training.batch import pipe_batches
from megatron.training.engine import build_engine
from megatron.training.evaluate import maybe_evaluator
from megatron.training.loop import Hooks, LoopContext, TrainState, train

_PRECISION_NAMES = {"bfloat16": "bf16", "fp16": "fp16", "fp32": "fp32", None: "fp32"}


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def speaks() -> bool:
    """Global rank 0 logs: the loss, grad norm and eval loss are broadcast to every rank
    (PipelineEngine broadcasts over the pipeline, we all-reduce over data parallelism)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _seed_tp_rng(args: Any) -> None:
    try:
        from megatron.mpu.random import model_parallel_manual_seed
    except ImportError:
        return
    model_parallel_manual_seed(int(getattr(args, "seed", 1234)))


def _tokenizer(args: Any) -> Any:
    from megatron.tokenizer import build_tokenizer, padded_vocab_size

    tokenizer = build_tokenizer(args)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = padded_vocab_size(
            tokenizer.vocab_size, int(getattr(args, "make_vocab_size_divisible_by", 128) or 1),
            int(getattr(args, "model_parallel_size", 1) or 1))
    return tokenizer


def _train_iters(args: Any, train_dataset: Any) -> int:
    iters = getattr(args, "train_iters", None)
    if iters:
        return int(iters)
    if getattr(args, "train_epochs", None) and train_dataset is not None:
        # build_datasets sized the train split to train_epochs, in whole global batches
        iters = len(train_dataset) // int(args.train_batch_size)
        args.train_iters = iters
        return int(iters)
    raise ConfigError("set train_iters (or train_epochs) so the run knows when to stop")


def checkpoint_hooks(args: Any) -> tuple[Any, Hooks]:
    """(load function or None, hooks) from ``megatron.checkpointing`` when it offers them."""
    try:
        ckpt = importlib.import_module("megatron.checkpointing")
    except ImportError:
        return None, Hooks()
    load = getattr(ckpt, "load", None)
    hooks = Hooks()
    maybe_save = getattr(ckpt, "maybe_save", None)
    if maybe_save is not None:
        hooks.after_step.append(maybe_save)
    at_exit = getattr(ckpt, "save_at_exit", None)
    if at_exit is not None:
        hooks.at_exit.append(at_exit)
    return load, hooks


def limit_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores: torch's default (every core per rank)
    oversubscribes a multi-rank run and made tiny runs ~20x slower here."""
    import os

    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_ranks))


def pretrain(args: Any) -> TrainState:
    limit_cpu_threads()
    setup_logging(speaks())
    log = get_logger()
    _seed_tp_rng(args)
    tokenizer = _tokenizer(args)
    eod = tokenizer.eod if getattr(args, "eod_mask_loss", False) else None
    splits = build_datasets(args, tokenizer)
    train_iters = _train_iters(args, splits.train)

    from megatron.neox_arguments import deepspeed_config

    eng = build_engine(args, deepspeed_config(args))
    config = eng.config
    log.info("model: %s parameters (%s without embeddings); %s", f"{num_parameters(config):,}",
             f"{num_parameters(config, include_embeddings=False):,}", "pipeline" if eng.is_pipe else "plain")

    state = TrainState()
    load, hooks = checkpoint_hooks(args)
    if load is not None and (getattr(args, "load", None) or getattr(args, "initialize_from", None)):
        loaded = load(eng, state, args)
        if isinstance(loaded, TrainState):
            state = loaded

    g = int(args.train_batch_size)
    layout = dict(global_batch_size=g, micro_batch_size=int(args.train_micro_batch_size_per_gpu),
                  dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size())
    device = _device()
    # read ahead by a background thread (num_workers micro-batches), pinned for asynchronous copies on a GPU
    micro = prefetched(MicroBatchIterator(splits.train, state.consumed_samples, **layout),
                       int(args.num_workers), device)
    pipe = pipe_batches(micro, eod, device) if eng.is_pipe else None
    seq = int(args.seq_length)
    precision = _PRECISION_NAMES.get(getattr(args, "precision", None), "fp32")
    ctx = LoopContext(
        eng=eng, args=args, micro_batches=micro, pipe_batches=pipe, device=device,
        train_iters=train_iters, global_batch_size=g, tokens_per_step=g * seq,
        flops_per_token=flops_per_token(config, seq), world_size=dist.get_world_size() if dist.is_initialized() else 1,
        peak_tflops=peak_tflops(current_device_name(), precision),
        writer=MetricsWriter(getattr(args, "log_dir", None), enabled=speaks()),
        valid=maybe_evaluator(eng, splits.valid, args, layout, device, eod),
        test=maybe_evaluator(eng, splits.test, args, layout, device, eod),
        eod_token=eod,
    )
    try:
        return train(ctx, state, hooks)
    finally:
        ctx.writer.close()
