"""The command line that starts a run: DeepSpeed's runner around the worker, or the worker alone.

Built as a plain ``argv`` list (no shell) so tests can inspect it without running pdsh/mpirun/srun,
and so paths with spaces survive. The worker gets the resolved config *path*
(``--deepy_config PATH``): every rank reads the same file and ``ps`` shows something readable.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron.launcher.environment import started_by_scheduler
from megatron.launcher.kinds import launcher_kind
from megatron.neox_arguments.deepspeed_split import runner_args

CONFIG_FLAG = "--deepy_config"


@dataclass(frozen=True)
class LaunchPlan:
    """What to execute, and why (printed before launching)."""

    argv: list[str]
    mode: str
    """``runner`` (DeepSpeed's runner starts the ranks) or ``in-place`` (a scheduler already did)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment."""
    multi_node: bool = False
    tool: str | None = None
    """Executable the multi-node backend needs, checked before running."""


def worker_argv(user_script: str, config_path: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-u", user_script, CONFIG_FLAG, config_path]


def runner_argv(args: Any, user_script: str, config_path: str, python: str | None = None) -> list[str]:
    """``python -m deepspeed.launcher.runner <runner flags> SCRIPT --deepy_config PATH``.

    The runner module rather than the ``deepspeed`` console script: it runs under the same
    interpreter as deepy.py, so a virtualenv without ``deepspeed`` on PATH still works.
    """
    return [python or sys.executable, "-u", "-m", "deepspeed.launcher.runner", *runner_args(args),
            user_script, CONFIG_FLAG, config_path]


def is_multi_node(args: Any, active: Mapping[str, list[int]]) -> bool:
    """Whether DeepSpeed's runner will take its multi-node path (and so need the backend tool)."""
    return bool(getattr(args, "force_multi", False)) or len(active) > 1


def plan_launch(
    args: Any,
    user_script: str,
    config_path: str,
    environ: Mapping[str, str],
    active: Mapping[str, list[int]] | None = None,
    python: str | None = None,
) -> LaunchPlan:
    """Decide how to start the ranks for ``args``.

    - deepy.py running as one task of ``srun``/``mpirun`` with ``deepspeed_slurm``/``deepspeed_mpi``:
      the scheduler has started every rank already, so run the worker in place; it maps the
      scheduler's rank variables (:func:`megatron.launcher.environment.distributed_env`).
    - otherwise: DeepSpeed's runner with the runner flags from the config; for more than one node
      it hands over to the ``launcher`` backend (pdsh, openmpi, mpich, mvapich, slurm).
    """
    slurm = bool(getattr(args, "deepspeed_slurm", False))
    mpi = bool(getattr(args, "deepspeed_mpi", False))
    source = started_by_scheduler(environ, slurm=slurm, mpi=mpi)
    if source is not None:
        return LaunchPlan(worker_argv(user_script, config_path, python), mode=f"in-place ({source.name})")
    kind = launcher_kind(getattr(args, "launcher", None) or "pdsh")
    multi = is_multi_node(args, active or {})
    return LaunchPlan(
        runner_argv(args, user_script, config_path, python),
        mode="runner",
        multi_node=multi,
        tool=kind.tool if multi else None,
    )
