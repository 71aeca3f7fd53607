"""Per-rank start-up: join torch.distributed, build the tp/pp/dp groups, seed the RNGs.

Called once by every worker (``train.py``, ``generate.py``, ...) right after reading the resolved
config. The rendezvous comes from the environment that DeepSpeed's launcher sets (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or is mapped from Slurm/MPI variables when srun/mpirun
started the worker directly (:mod:`megatron.launcher.environment`).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from datetime import timedelta

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from megatron.deepspeed_internals import (
    defer_muon_kernel_compiles,
    skip_shared_memory_comm_op,
    use_current_collective_names,
)
from megatron.errors import ConfigError
from megatron.launcher.watchdog import start_launcher_watchdog
from megatron.torch_internals import set_collective_timeouts
from megatron.launcher.environment import distributed_env, hidden_gpus_problem
from megatron.mpu.parallel_config import ParallelRun
from megatron.mpu import Coordinates, initialize_model_parallel
from megatron.mpu.experts import initialize_expert_parallel
from megatron.mpu.hybrid_shard import initialize_hybrid_shard
from megatron.mpu.topology import get_coordinates, get_topology

logger = logging.getLogger(__name__)

INIT_TIMEOUT_SECONDS = 3600
"""``init_timeout_seconds``'s default (megatron/training/hang_config.py), for workers that do not pass it."""


def backend_for(chosen: str | None) -> str:
    """``distributed_backend`` if set, else nccl with CUDA and gloo without."""
    if chosen:
        if chosen == "nccl" and not torch.cuda.is_available():
            raise ConfigError("distributed_backend='nccl' needs CUDA GPUs: use gloo on CPU, or remove the key")
        return str(chosen)
    return "nccl" if torch.cuda.is_available() else "gloo"


def set_seeds(seed: int) -> None:
    """The same seed on every rank: weights are initialised from (seed, parameter name) and then
    sharded, so every layout starts from identical weights; per-rank streams (dropout inside
    tensor-parallel regions) are derived from this by the mpu RNG tracker."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def init_distributed(parallel: ParallelRun, timeout_seconds: int = INIT_TIMEOUT_SECONDS) -> None:
    """Join the process group described by the environment (idempotent); its collectives time out after
    ``timeout_seconds`` (``init_timeout_seconds``) until the first step sets ``train_timeout_seconds``."""
    env = distributed_env(
        os.environ,
        master_addr=parallel.master_addr,
        master_port=parallel.master_port,
        prefer_slurm=parallel.deepspeed_slurm,
    )
    hidden = hidden_gpus_problem(os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if hidden:
        raise ConfigError(hidden)
    local_rank = int(env["LOCAL_RANK"])
    if torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        # a task bound to fewer devices than its local id (Slurm --gpus-per-task without
        # CUDA_VISIBLE_DEVICES): DeepSpeed's engine calls set_device(LOCAL_RANK) too
        env["LOCAL_RANK"] = str(local_rank % torch.cuda.device_count())
    os.environ.update(env)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    defer_muon_kernel_compiles()
    if torch.distributed.is_initialized():
        return
    backend = backend_for(parallel.distributed_backend)
    if backend == "gloo":
        skip_shared_memory_comm_op()
    join_torchrun_attempt(backend, env, timeout_seconds)
    # Through DeepSpeed so its comm layer (used by the engine and ZeRO) wraps the same group;
    # auto_mpi_discovery stays off because the environment mapping above already did that job.
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_seconds),
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
    )
    use_current_collective_names()  # DeepSpeed's flat gathers without torch's deprecation warning on every rank


def join_torchrun_attempt(backend: str, env: dict[str, str], timeout_seconds: int) -> None:
    """Under torchrun, join the process group through a store of this attempt's own keys.

    torchrun's workers share its agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``), and torch 2.13's
    ``_create_c10d_store`` adds no per-attempt prefix, trusting that every restart gets a new store. With the c10d
    rendezvous it does not: a restarted attempt gets the same MASTER_PORT, and gloo then reads the peer addresses
    the killed attempt published there and fails to connect ("Gloo connectFullMesh failed ... Connection
    refused"), or new_group waits forever. So: the same store, keys under ``deepy/attempt_<restart>``
    (tests/e2e/test_torchrun.py restarts after a kill -9). DeepSpeed's init_distributed then wraps this group."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    timeout = timedelta(seconds=timeout_seconds)
    store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                                       is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore(f"deepy/attempt_{attempt}", store),
                                         rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout)


def initialize(parallel: ParallelRun, seed: int, announce: bool = False,
               timeout_seconds: int = INIT_TIMEOUT_SECONDS) -> Coordinates:
    """Distributed start-up for one rank; returns (and with ``announce`` prints) where this rank sits
    in the grid. ``timeout_seconds``: every process group's collective timeout (``init_timeout_seconds``)."""
    start_launcher_watchdog()  # a local launch's rank ends with the deepy.py that started it
    init_distributed(parallel, timeout_seconds)
    world = torch.distributed.get_world_size()
    expected = parallel.world_size
    if expected is not None and expected != world:
        raise ConfigError(
            f"the config was checked for world_size={expected} but {world} ranks started: "
            f"launch through deepy.py, or set num_gpus/hostfile to match"
        )
    initialize_model_parallel(parallel.model_parallel_size, parallel.pipe_parallel_size, parallel.context_parallel_size)
    # experts split over groups of data-parallel ranks (1: no such groups)
    initialize_expert_parallel(parallel.moe_expert_parallel_size)
    # ZeRO-3 shard groups and their replicas under sharding_strategy: hsdp (None: not built)
    initialize_hybrid_shard(parallel.sharding_group_size)
    # the groups above were created with torch's default timeout, not the world's
    set_collective_timeouts(timedelta(seconds=timeout_seconds))
    set_seeds(seed)
    coords = get_coordinates()
    get_topology()  # raises if the groups were not built
    if announce:
        # one write per line: ranks share the launcher's pipe and print() writes the newline separately
        sys.stdout.write(f"deepy: {coords} world={world}\n")
        sys.stdout.flush()
    return coords


def exit_process(code: int | str | None) -> None:
    """Leave the job without running the interpreter's teardown.

    After training, gloo's and DeepSpeed's background threads can still be alive when Python
    destroys its modules; one of them then aborts ("terminate called without an active exception",
    exit -6) and DeepSpeed's launcher reports the whole run as failed although every result was
    written. So: flush what we printed, tear the process group down while everything is still
    alive, and leave with ``os._exit`` and the intended code.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message") semantics
        print(code, file=sys.stderr)
        status = 1
    try:
        if dist.is_available() and dist.is_initialized():
            if status == 0:
                dist.barrier()  # nobody leaves while another rank still talks to it
            dist.destroy_process_group()
    except Exception as err:  # teardown must not turn a good run into a failure
        logging.getLogger(__name__).debug("process group teardown failed: %s", err)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
