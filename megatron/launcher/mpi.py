"""``launcher: openmpi | mpich | mvapich``: ``mpirun`` starts every rank on the hosts of the pool.

Each rank is the worker itself; it reads its place from the MPI implementation's variables
(``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``MV2_COMM_WORLD_RANK``; see
:mod:`megatron.launcher.environment`) and meets the others at ``MASTER_ADDR:MASTER_PORT``, which
deepy exports. Training talks through torch.distributed (gloo/nccl), not MPI: mpirun only starts
processes, passes signals and ends the job when a rank fails.

Why not DeepSpeed's runner (``--launcher openmpi``): in 0.19.8 it needs a hostfile even on one
machine, refuses include/exclude/num_nodes/num_gpus with a traceback, gives every rank
``--mca btl_tcp_if_include eth0`` whatever the interfaces are called, and exports no rendezvous
address to Open MPI ranks. The argument shapes for MPICH and MVAPICH2 (Hydra's ``-n/-ppn/-hosts``
and ``-genv``) follow DeepSpeed's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from megatron.errors import ConfigError
from megatron.launcher.plan import LaunchPlan, PlanInputs
from megatron.launcher.rendezvous import check_first_host_reachable, rendezvous

# Open MPI passes the environment to ranks on *other* hosts only by name (``-x NAME``, the value
# stays off the command line). These are the variables a rank may need there.
FORWARDED_PREFIXES: tuple[str, ...] = (
    "PYTHON", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_", "MASTER_", "DEEPY_", "WANDB_", "HF_",
    "TRANSFORMERS_", "TOKENIZERS_", "NCCL_", "CUDA_", "TORCH", "OMP_", "MKL_", "UCX_", "MLFLOW_",
)  # fmt: skip

# MVAPICH2 settings DeepSpeed's runner exports for deep-learning jobs: no CMA kernel module,
# MPI_THREAD_MULTIPLE support, and no CPU affinity (which would pin every rank's threads to one core).
MVAPICH_ENV: dict[str, str] = {"MV2_SMP_USE_CMA": "0", "MV2_SUPPORT_DL": "1", "MV2_ENABLE_AFFINITY": "0"}

ROOT_HINT = (
    "Open MPI refuses to start ranks as root: run as another user, or export "
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 if you mean it"
)


def forwarded_names(environ: Mapping[str, str]) -> list[str]:
    names = [n for n in environ if n.startswith(FORWARDED_PREFIXES) and not n.startswith("OMPI_")]
    return sorted(set(names) | {"MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"})


def whole_hosts(kind: str, active: Mapping[str, list[int]]) -> None:
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise ConfigError(
                f"launcher={kind!r} cannot start ranks on chosen slots {slots} of {host!r} (mpirun places "
                f"ranks by count): filter whole hosts in include/exclude, or set num_gpus"
            )


def openmpi_argv(inputs: PlanInputs, environ: Mapping[str, str]) -> list[str]:
    hosts = ",".join(f"{host}:{len(slots)}" for host, slots in inputs.active.items())
    argv = ["mpirun", "-n", str(inputs.world_size), "--host", hosts,
            # Open MPI binds each rank to one core by default; torch's threads need them all
            "--bind-to", "none"]  # fmt: skip
    for name in forwarded_names(environ):
        argv += ["-x", name]
    return [*argv, *inputs.worker]


def hydra_argv(inputs: PlanInputs, kind: str, extra_env: Mapping[str, str]) -> list[str]:
    """MPICH / MVAPICH2 ``mpirun`` (Hydra): it passes the whole environment on by itself."""
    counts = {len(slots) for slots in inputs.active.values()}
    if len(counts) != 1:
        per_host = {host: len(slots) for host, slots in inputs.active.items()}
        raise ConfigError(
            f"launcher={kind!r} starts the same number of ranks on every host, and the pool has {per_host}: "
            f"set num_gpus, or make the hostfile's slots equal"
        )
    argv = ["mpirun", "-n", str(inputs.world_size), "-ppn", str(counts.pop()), "-hosts", ",".join(inputs.active)]
    for name, value in extra_env.items():
        argv += ["-genv", name, value]
    return [*argv, *inputs.worker]


def plan_mpi(inputs: PlanInputs, kind: str) -> LaunchPlan:
    whole_hosts(kind, inputs.active)
    hosts = list(inputs.active)
    check_first_host_reachable(inputs.config, hosts)
    meeting = rendezvous(inputs.config, hosts[0], inputs.master_port_given)
    env = {"MASTER_ADDR": meeting.addr, "MASTER_PORT": str(meeting.port)}
    if kind == "openmpi":
        tools: tuple[str, ...] = ("mpirun", "ompi_info")
        if os.geteuid() == 0 and not _root_allowed(inputs.environ):
            # both things to fix in one message, not the second one after the first is fixed
            missing = [tool for tool in tools if shutil.which(tool) is None]
            also = (f"; and this launch needs {', '.join(repr(t) for t in missing)} on PATH, which is not installed "
                    f"here: install Open MPI, or pick another launcher") if missing else ""
            raise ConfigError(ROOT_HINT + also)
        argv = openmpi_argv(inputs, {**inputs.environ, **env})
    else:
        extra = {**env, **(MVAPICH_ENV if kind == "mvapich" else {})}
        argv = hydra_argv(inputs, kind, extra)
        tools = ("mpirun", "mpiname") if kind == "mvapich" else ("mpirun",)
    return LaunchPlan(
        argv=argv,
        mode=f"mpirun ({kind})",
        world_size=inputs.world_size,
        config_path=inputs.config_path,
        env=env,
        tools=tools,
        stop_route="launcher",  # mpirun passes SIGUSR1 on to every rank (SIGTERM would kill them)
        hosts=tuple(hosts),
        master_addr=meeting.addr,
        master_port=meeting.port,
    )


def _root_allowed(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("OMPI_ALLOW_RUN_AS_ROOT")) and bool(environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"))
