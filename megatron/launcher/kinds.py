"""The multi-node launchers Deepy accepts, keyed by the ``launcher`` config string.

Every kind goes through DeepSpeed's runner (``--launcher <name>``), which builds the pdsh/mpirun/srun
command itself; what Deepy adds per kind is the tool that must exist on this machine (checked
before launching so a missing ``pdsh`` is a clear message, not a runner traceback) and whether the
workers it starts get RANK/WORLD_SIZE from DeepSpeed or must map them from the scheduler's
variables (see :mod:`megatron.launcher.environment`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LauncherKind:
    name: str
    """The value of the ``launcher`` key and of DeepSpeed runner's ``--launcher``."""
    tool: str
    """Executable DeepSpeed's runner looks for (``backend_exists``)."""
    starts_workers_directly: bool
    """True when the backend runs the user script itself (no DeepSpeed per-node launcher), so each
    worker maps the scheduler's rank variables."""
    doc: str


LAUNCHERS: dict[str, LauncherKind] = {
    kind.name: kind
    for kind in (
        LauncherKind("pdsh", "pdsh", False, "ssh fan-out; each node runs DeepSpeed's per-node launcher"),
        LauncherKind("openmpi", "ompi_info", True, "mpirun (Open MPI) starts every rank"),
        LauncherKind("mpich", "mpirun", True, "mpirun (MPICH) starts every rank"),
        LauncherKind("mvapich", "mpiname", True, "mpirun_rsh (MVAPICH2) starts every rank"),
        LauncherKind("slurm", "sinfo", True, "srun starts every rank inside the allocation"),
    )
}


def launcher_kind(name: str) -> LauncherKind:
    from megatron.errors import ConfigError

    try:
        return LAUNCHERS[name]
    except KeyError:
        raise ConfigError(f"launcher={name!r} is unknown: use one of {', '.join(LAUNCHERS)}") from None
