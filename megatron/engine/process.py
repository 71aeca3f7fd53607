"""What each rank's process sets for itself before it builds a model, training or generating: its share of
the machine's CPU cores, and whether it is the rank that logs."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def speaks() -> bool:
    """Global rank 0 logs: the loss, grad norm and eval loss are broadcast to every rank
    (PipelineEngine broadcasts over the pipeline, we all-reduce over data parallelism)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def limit_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores: torch's default (every core per rank)
    oversubscribes a multi-rank run and made tiny runs ~20x slower here."""
    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_ranks))
