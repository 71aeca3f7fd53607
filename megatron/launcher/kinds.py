"""The launchers Deepy accepts, keyed by the ``launcher`` config string.

- ``pdsh`` (default): DeepSpeed's runner; local ranks on one host, pdsh + ssh across hosts.
- ``openmpi`` / ``mpich`` / ``mvapich``: ``mpirun`` starts every rank (:mod:`megatron.launcher.mpi`).
- ``slurm``: ``srun`` starts every rank inside the allocation (:mod:`megatron.launcher.slurm`).
- ``torchrun``: torch's elastic agent on every node starts the ranks (:mod:`megatron.launcher.torchrun`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from megatron.errors import ConfigError
from megatron.launcher.deepspeed_runner import plan_deepspeed_runner
from megatron.launcher.mpi import plan_mpi
from megatron.launcher.plan import LaunchPlan, PlanInputs
from megatron.launcher.slurm import plan_slurm
from megatron.launcher.torchrun import plan_torchrun


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherKind:
    name: str
    """The value of the ``launcher`` key."""
    doc: str
    build: Callable[[PlanInputs], LaunchPlan]


LAUNCHERS: dict[str, LauncherKind] = {
    kind.name: kind
    for kind in (
        LauncherKind(name="pdsh", doc="DeepSpeed's runner: local ranks, or pdsh/ssh to every host",
                     build=plan_deepspeed_runner),
        LauncherKind(name="openmpi", doc="mpirun (Open MPI) starts every rank", build=partial(plan_mpi, kind="openmpi")),
        LauncherKind(name="mpich", doc="mpirun (MPICH Hydra) starts every rank", build=partial(plan_mpi, kind="mpich")),
        LauncherKind(name="mvapich", doc="mpirun (MVAPICH2) starts every rank", build=partial(plan_mpi, kind="mvapich")),
        LauncherKind(name="slurm", doc="srun starts every rank inside the allocation", build=plan_slurm),
        LauncherKind(name="torchrun", doc="torchrun's elastic agent on every node (srun in a Slurm allocation, pdsh "
                                          "over a hostfile) starts the ranks and restarts them", build=plan_torchrun),
    )
}  # fmt: skip


def launcher_kind(name: str) -> LauncherKind:
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise ConfigError(f"launcher={name!r} is unknown: use one of {', '.join(LAUNCHERS)}") from None
