"""A launch, decided but not started: the command, its environment, and how a stop request reaches the ranks.

Built as a plain ``argv`` list (no shell) so tests can inspect it without running
pdsh/mpirun/srun, and so paths with spaces survive. The worker gets the resolved config *path*
(``--deepy_config PATH``): every rank reads the same file and ``ps`` shows something readable.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.logging.config import LoggingArgs

CONFIG_FLAG = "--deepy_config"

StopRoute = Literal["ranks", "launcher", "pdsh"]
"""How a stop request (deepy got SIGTERM/SIGINT/SIGHUP/SIGUSR1) reaches every rank:

- ``ranks``: deepy finds the rank processes it started on this machine and signals each one
  (DeepSpeed's per-node launcher forwards nothing and its runner none on one node);
- ``launcher``: the started command passes SIGUSR1 on to every rank itself (``srun``, ``mpirun``,
  or the worker when deepy runs it in place);
- ``pdsh``: deepy signals the ranks on every host through pdsh (they are not its descendants).
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """What to execute, and why (printed before launching)."""

    argv: list[str]
    mode: str
    """How the ranks start, in words: ``local``, ``pdsh``, ``srun``, ``mpirun (openmpi)``, ``in-place (slurm)``."""
    world_size: int
    config_path: str
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment (never secrets: those are inherited as they are)."""
    tools: tuple[str, ...] = ()
    """Executables the launch needs, checked before running."""
    stop_route: StopRoute = "ranks"
    hosts: tuple[str, ...] = ()
    """Hosts the ranks run on (for ``pdsh`` stop requests)."""
    master_addr: str | None = None
    master_port: int | None = None
    in_place: bool = False
    """deepy runs the worker itself (it was started as one task of srun/mpirun)."""
    restarts_itself: bool = False
    """The launched command restarts failed ranks itself (torchrun's agents, ``max_restarts`` passed on to them):
    deepy.py does not launch again."""
    worker_prefix: str | None = None
    """What comes before ``--deepy_config PATH`` on a rank's command line, where the pdsh stop route must tell the
    ranks from the launchers by it (torchrun's agents end the same: ``... SCRIPT --deepy_config PATH``); None: a
    rank's ``--local_rank=N`` (DeepSpeed's per-node launcher)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """What every launcher kind builds its plan from."""

    config: DeepSpeedRunnerArgs
    """The arguments, typed as the launcher's keys."""
    logging: LoggingArgs
    """The arguments, typed as the logging keys: DeepSpeed's runner logs at ``deepspeed_log_level``."""
    master_port_given: bool = False
    """The user chose ``master_port`` (else a free port is picked where the launch is local)."""
    user_script: str
    config_path: str
    environ: Mapping[str, str]
    pool: dict[str, list[int]]
    """Every slot known (hostfile, this machine, or the Slurm allocation)."""
    active: dict[str, list[int]]
    """The slots the ranks run on (after include/exclude/num_nodes/num_gpus)."""
    python: str = sys.executable

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.active.values())

    @property
    def worker(self) -> list[str]:
        return worker_argv(self.user_script, self.config_path, self.python)


def worker_argv(user_script: str, config_path: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-u", user_script, CONFIG_FLAG, config_path]
