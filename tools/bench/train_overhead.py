#!/usr/bin/env python
"""Trainer overhead: Deepy's training step (DeepSpeed engine + our model) against a minimal
raw-PyTorch loop of the identical model, optimizer, schedule, clipping and batch, in one process.

    python tools/bench/train_overhead.py [--layers 4 --hidden 256 --seq 256 --batch 8] [--zero 0]

Both sides start from the same weights (initialisation is a function of seed and parameter name)
and run the same fixed batch. Measurement alternates blocks of steps between the two so that load
from other processes on a shared machine hits both alike; the best and median blocks are reported. The goal
is ours/raw >= 0.95.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="micro-batch = global batch (1 rank, no accumulation)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage of the engine")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: DeepSpeed's bf16 engine vs torch.autocast in the raw loop (GPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=6, help="timed blocks per side")
    return p.parse_args(argv)


def bench_config(o: argparse.Namespace) -> dict[str, Any]:
    """The run as a config mapping; it goes through the real loader and rules like a YAML file."""
    return dict(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, seq_length=o.seq,
        max_position_embeddings=o.seq, padded_vocab_size=o.vocab, pos_emb="rotary", norm="layernorm",
        hidden_dropout=0.0, attention_dropout=0.0, seed=1234, precision="bfloat16" if o.precision == "bf16" else "fp32",
        optimizer={"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
        weight_decay=0.1, lr_decay_style="cosine", warmup=0.01, min_lr=3e-5, train_iters=10_000,
        train_batch_size=o.batch, train_micro_batch_size_per_gpu=o.batch, gradient_clipping=1.0,
        zero_optimization={"stage": o.zero}, steps_per_print=10**9,
        use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
    )


def init_single_process() -> None:
    import deepspeed
    import torch.distributed as dist

    from megatron import mpu

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:  # any free port: several benchmarks may run side by side
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        import torch

        from megatron.deepspeed_internals import skip_shared_memory_comm_op

        if not torch.cuda.is_available():
            skip_shared_memory_comm_op()
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   auto_mpi_discovery=False)
    mpu.initialize_model_parallel(1, 0)


def timed(step: Any, n: int, sync: Any) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    import torch
    from deepspeed.accelerator import get_accelerator

    init_single_process()
    from megatron.data.sampler import collate
    from megatron.model import GPTModel, lm_loss
    from megatron.training.batch import lm_batch
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.engine import build_engine
    from megatron.training.lr_schedules import LRScheduler
    from megatron.training.optimizers import build_optimizer
    from megatron.training.step import train_step

    device = torch.device(get_accelerator().current_device_name())
    sync = get_accelerator().synchronize
    run = RunConfig.from_mapping(bench_config(o))
    model_config = run.model.with_vocab(o.vocab)
    train_iters = run.training.train_iters or 1

    # one fixed batch, as the sampler would deliver it
    gen = torch.Generator().manual_seed(0)
    sample = {"text": torch.randint(0, o.vocab, (o.batch, o.seq + 1), generator=gen)}
    samples = [{"text": row.numpy()} for row in sample["text"]]
    micro = itertools.repeat(collate(samples))

    # --- ours: the trainer's own engine and train step
    eng = build_engine(run, model_config, train_iters)

    def ours() -> None:
        train_step(eng, micro, device)

    # --- raw: the identical model/optimizer/schedule in a plain loop
    model = GPTModel(model_config).to(device)
    optimizer = build_optimizer(model, run.optimizer)
    scheduler = LRScheduler(optimizer, run.lr.spec(train_iters, run.optimizer.lr))
    batch = lm_batch(collate(samples), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=o.precision == "bf16")

    def raw() -> None:
        with autocast:
            loss = lm_loss(model(batch.tokens), batch.labels, batch.loss_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    for _ in range(o.warmup):
        ours()
        raw()
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for r in range(o.rounds):
        # alternate which side goes first so drift in machine load does not favour one
        order = [("ours", ours), ("raw", raw)] if r % 2 == 0 else [("raw", raw), ("ours", ours)]
        for name, fn in order:
            times[name].append(timed(fn, o.block, sync))
    tokens = o.batch * o.seq * o.block
    # best block: on a shared machine other processes only ever slow a block down, so the fastest
    # block is the least disturbed estimate of each side; the median is shown for reference
    best = {k: tokens / min(v) for k, v in times.items()}
    median = {k: tokens / statistics.median(v) for k, v in times.items()}
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: {o.layers} layers x {o.hidden} hidden, seq {o.seq}, batch {o.batch}, vocab {o.vocab}, "
          f"{o.precision}, ZeRO-{o.zero}; device: {dev}; {o.rounds} blocks of {o.block} steps per side")
    print(f"deepy (DeepSpeed engine): {best['ours']:,.0f} tokens/s best block, {median['ours']:,.0f} median")
    print(f"raw PyTorch loop:         {best['raw']:,.0f} tokens/s best block, {median['raw']:,.0f} median")
    print(f"ratio deepy/raw: {best['ours'] / best['raw']:.3f} best, {median['ours'] / median['raw']:.3f} median "
          f"(goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
