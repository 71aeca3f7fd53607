"""Dropout RNG for tensor parallelism, on DeepSpeed's activation-checkpointing tracker.

Two streams: the default generator (seeded with `seed`, the same on all tp ranks, so dropout on
replicated activations agrees) and a tracked "model-parallel" stream (`seed + 2718 + tp_rank`,
different per tp rank, so dropout on sharded activations is independent across shards).

We use DeepSpeed's own tracker (`deepspeed.checkpointing.get_cuda_rng_tracker`) so that its
activation checkpointing restores the same stream when it recomputes a layer. Despite the name,
the tracker goes through `get_accelerator()`: on CPU it saves/restores the CPU generator, which
works (checked on deepspeed 0.19.8), so no separate tracker is needed. We seed it ourselves instead
of calling `model_parallel_cuda_manual_seed`, which reads the tp rank from the module-global `mpu`
that only `deepspeed.checkpointing.configure` sets.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from megatron.deepspeed_internals import model_parallel_rng_tracker_name
from megatron.mpu.topology import get_tensor_model_parallel_rank

MODEL_PARALLEL_RNG = model_parallel_rng_tracker_name()
_TP_SEED_OFFSET = 2718  # any positive offset keeps the tracked stream apart from the default one


def get_rng_tracker() -> ds_checkpointing.CudaRNGStatesTracker:
    return ds_checkpointing.get_cuda_rng_tracker()


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` and the tracked stream with `seed + 2718 + tp_rank`.

    Call after `initialize_model_parallel` on every rank.
    """
    tracker = get_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    get_accelerator().manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + get_tensor_model_parallel_rank())


@contextlib.contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """Run the block on the per-tp-rank stream (for dropout on sharded activations).

    Without a seeded tracker (a single-process model) this is the default stream.
    """
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG in tracker.get_states():
        with tracker.fork(MODEL_PARALLEL_RNG):
            yield
    else:
        yield
