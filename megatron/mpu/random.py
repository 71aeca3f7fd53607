"""Dropout RNG for tensor parallelism, on DeepSpeed's activation-checkpointing tracker.

Two streams: the default generator (the same on all tp ranks, so dropout on replicated activations
agrees) and a tracked "model-parallel" stream (offset by 2718 + tp_rank from it, different per tp
rank, so dropout on sharded activations is independent across shards). Both are offset per pipeline
stage (``100 * pp_rank``, as Megatron-LM's ``_set_random_seed`` does: megatron/training/initialize.py
at 2fd6e2b; GPT-NeoX's at ea7aefd seeds every stage alike) and per context-parallel rank
(``10_000 * cp_rank``): otherwise every stage would draw the same masks for its layers (layer 0 and
layer L/2 of a two-stage pipeline dropping the same units) and every context-parallel rank the same
masks for its piece of the sequence. A one-stage run without context parallelism keeps ``seed``.

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
from megatron.mpu.topology import get_context_parallel_rank, get_pipe_parallel_rank, get_tensor_model_parallel_rank

MODEL_PARALLEL_RNG = model_parallel_rng_tracker_name()
_TP_SEED_OFFSET = 2718  # any positive offset keeps the tracked stream apart from the default one
_STAGE_SEED_OFFSET = 100  # Megatron-LM's per-stage offset; 27 stages stay clear of the tracked stream
_CONTEXT_SEED_OFFSET = 10_000  # above every stage and tensor-parallel offset


def get_rng_tracker() -> ds_checkpointing.CudaRNGStatesTracker:
    return ds_checkpointing.get_cuda_rng_tracker()


def stream_seeds(seed: int, tp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> tuple[int, int]:
    """(default stream, tracked tensor-parallel stream) seeds of the rank at these coordinates."""
    base = seed + _STAGE_SEED_OFFSET * pp_rank + _CONTEXT_SEED_OFFSET * cp_rank
    return base, base + _TP_SEED_OFFSET + tp_rank


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default and the tracked stream of this rank (:func:`stream_seeds`).

    Call after `initialize_model_parallel` on every rank.
    """
    default, tracked = stream_seeds(seed, get_tensor_model_parallel_rank(), get_pipe_parallel_rank(),
                                    get_context_parallel_rank())
    tracker = get_rng_tracker()
    tracker.reset()
    torch.manual_seed(default)
    get_accelerator().manual_seed(default)
    tracker.add(MODEL_PARALLEL_RNG, tracked)


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
