"""Each rank's place in the job (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) from whoever started it.

DeepSpeed's local launcher (``deepspeed.launcher.launch``) sets these variables itself. Its multi-node
backends do not always: ``srun`` (launcher: slurm, or a user running ``srun python train.py``) and
``mpirun`` (openmpi, mpich, mvapich) start the worker directly and only set their own variables. This
module maps those to the ``env://`` names torch.distributed reads, as GPT-NeoX's ``deepspeed_slurm`` /
``deepspeed_mpi`` options do. Pure functions of the environment mapping so they are unit-testable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from megatron.errors import ConfigError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RankSource:
    """Names of one scheduler's variables for rank, local rank and world size."""

    name: str
    rank: str
    local_rank: str
    world_size: str


# Order matters: a job step under Slurm that runs mpirun has both sets; mpirun's are the inner ones.
MPI_SOURCES: tuple[RankSource, ...] = (
    RankSource("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    RankSource("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_SIZE"),
    RankSource("mpich", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)
SLURM_SOURCE = RankSource("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")


def detect_source(environ: Mapping[str, str], prefer_slurm: bool = False) -> RankSource | None:
    """The scheduler that started this process, or ``None`` when only RANK/... (or nothing) is set."""
    mpi = next((src for src in MPI_SOURCES if src.rank in environ and src.world_size in environ), None)
    slurm = SLURM_SOURCE if SLURM_SOURCE.rank in environ and SLURM_SOURCE.world_size in environ else None
    if prefer_slurm and slurm is not None:
        return slurm
    return mpi or slurm


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``node[3-5,9],gpu1`` -> ``node3``.

    ``scontrol show hostnames`` is the authority when it exists; the fallback parses the common
    ``prefix[range,...]`` form so workers need no Slurm binaries.
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.match(r"^([^\[]+)\[([^\]]+)\](.*)$", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}{suffix}"


def visible_devices(environ: Mapping[str, str]) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (ids, UUIDs or MIG names); [] when it is unset or empty."""
    return [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]


def device_local_rank(local_rank: int, environ: Mapping[str, str]) -> int:
    """The device index a scheduler-started rank uses among the devices it can see.

    Slurm's ``SLURM_LOCALID`` (and MPI's local rank) count the tasks of a node. A job that binds
    devices per task (``--gpus-per-task=1``, ``--gpu-bind``) shows each task only its own GPUs, so
    ``LOCAL_RANK=3`` would make DeepSpeed's engine call ``set_device(3)`` with one visible device
    ("invalid device ordinal"): the rank's index is then its local id modulo what it sees."""
    seen = len(visible_devices(environ))
    return local_rank % seen if seen and local_rank >= seen else local_rank


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
"""One entry per NVIDIA GPU of the node, whatever the job's cgroup lets it open."""


def hidden_gpus_problem(environ: Mapping[str, str], visible_count: int, gpus_dir: str = NVIDIA_GPUS) -> str | None:
    """A Slurm task on a node with NVIDIA GPUs that sees none of them: the job asked for no GPUs
    (``--gpus-per-node``/``--gres=gpu``) and would silently train on the CPU. ``CUDA_VISIBLE_DEVICES``
    set (even empty) is a choice, and is left alone."""
    if not environ.get("SLURM_JOB_ID") or visible_count > 0 or "CUDA_VISIBLE_DEVICES" in environ:
        return None
    try:
        present = len(os.listdir(gpus_dir))
    except OSError:
        return None
    if not present:
        return None
    return (f"this node has {present} NVIDIA GPU(s) but Slurm job {environ['SLURM_JOB_ID']} was given none, so "
            f"rank {environ.get('SLURM_PROCID', '?')} would train on the CPU: request them (#SBATCH "
            f"--gpus-per-node=N, or --gres=gpu:N), or set CUDA_VISIBLE_DEVICES= to train on the CPU on purpose")


def distributed_env(
    environ: Mapping[str, str],
    master_addr: str | None = None,
    master_port: int | None = None,
    prefer_slurm: bool = False,
) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for this process.

    Precedence: variables already set (DeepSpeed's launcher, torchrun) > MPI/Slurm variables >
    a single-process run (``python train.py --deepy_config ...`` on its own).
    """
    port = str(environ.get("MASTER_PORT") or master_port or DEFAULT_MASTER_PORT)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {
            "RANK": environ["RANK"],
            "LOCAL_RANK": environ.get("LOCAL_RANK", "0"),
            "WORLD_SIZE": environ["WORLD_SIZE"],
            "MASTER_ADDR": environ.get("MASTER_ADDR") or master_addr or "127.0.0.1",
            "MASTER_PORT": port,
        }
    source = detect_source(environ, prefer_slurm=prefer_slurm)
    if source is None:
        return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": master_addr or "127.0.0.1", "MASTER_PORT": port}
    addr = environ.get("MASTER_ADDR") or master_addr
    if not addr and source is SLURM_SOURCE:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if nodelist:
            addr = first_slurm_host(nodelist)
    world = environ[source.world_size]
    if not addr:
        if world == "1":
            addr = "127.0.0.1"
        else:
            raise ConfigError(
                f"started by {source.name} ({source.rank}={environ[source.rank]}, "
                f"{source.world_size}={world}) but no rendezvous address: set master_addr in the "
                f"config or export MASTER_ADDR"
            )
    return {
        "RANK": environ[source.rank],
        "LOCAL_RANK": str(device_local_rank(int(environ.get(source.local_rank, "0")), environ)),
        "WORLD_SIZE": world,
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }


def started_by_scheduler(environ: Mapping[str, str], slurm: bool, mpi: bool) -> RankSource | None:
    """When deepy.py itself runs as one task of ``srun``/``mpirun`` with deepspeed_slurm/mpi set.

    Then the scheduler has already started one process per rank, so deepy.py must run the worker in
    place instead of asking DeepSpeed's runner to start ranks again.
    """
    if "RANK" in environ:
        return None
    # the batch script of an sbatch job has SLURM_PROCID=0 and SLURM_NTASKS too, but is no task
    # of a job step: there deepy must start the ranks itself (launcher: slurm runs srun)
    step_task = "SLURM_STEP_ID" in environ
    source = detect_source(environ, prefer_slurm=slurm and step_task)
    if source is None:
        return None
    if slurm and source is SLURM_SOURCE and step_task:
        return source
    if mpi and source is not SLURM_SOURCE:
        return source
    return None
