"""One process as a whole gloo world of one rank, as DeepSpeed's engine needs it: for the unit tests that
build a real DeepSpeed engine in the pytest worker itself."""

from __future__ import annotations

import os

from ports import free_port  # tests/ports.py: a port range per xdist worker


def init_single_rank_gloo() -> None:
    """``torch.distributed`` on gloo with this process as rank 0 of 1 (once per process)."""
    import deepspeed
    import torch.distributed as dist

    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    skip_shared_memory_comm_op()  # as train.py: no /dev/shm buffers left behind by DeepSpeed's op
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
