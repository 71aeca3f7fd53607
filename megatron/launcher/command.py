"""Decide how a run starts: which command, which environment, how many ranks.

- deepy.py running as one task of ``srun``/``mpirun`` with ``deepspeed_slurm``/``deepspeed_mpi``:
  the scheduler has started every rank already, so the worker runs in place; it maps the
  scheduler's rank variables (:func:`megatron.launcher.environment.distributed_env`).
- otherwise the ``launcher`` kind builds the command (:mod:`megatron.launcher.kinds`).

Everything here runs before anything starts, so every problem (a busy ``master_port``, a missing
``srun``, a slot filter mpirun cannot honour) is one clear error with exit code 2.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping

from megatron.errors import ConfigError
from megatron.launcher.config import DeepSpeedRunnerArgs, master_port_chosen
from megatron.launcher.environment import started_by_scheduler
from megatron.launcher.kinds import launcher_kind
from megatron.logging.config import LoggingArgs
from megatron.launcher.plan import LaunchPlan, PlanInputs, worker_argv
from megatron.launcher.resources import resource_pool, select_active


def _one_device() -> int:
    return 1


def plan_launch(
    config: DeepSpeedRunnerArgs,
    user_script: str,
    config_path: str,
    environ: Mapping[str, str],
    local_devices: Callable[[], int] = _one_device,
    python: str | None = None,
    provenance: Mapping[str, str] | None = None,
    *,
    logging: LoggingArgs,
) -> LaunchPlan:
    """The launch of ``user_script --deepy_config config_path`` for ``config`` (the arguments, typed as the
    launcher's keys; ``logging``: the same, typed as the logging keys); ``provenance`` (the resolved
    config's) tells whether ``master_port`` was chosen."""
    python = python or sys.executable
    source = started_by_scheduler(environ, slurm=config.deepspeed_slurm, mpi=config.deepspeed_mpi)
    if source is not None:
        return LaunchPlan(
            argv=worker_argv(user_script, config_path, python),
            mode=f"in-place ({source.name})",
            world_size=int(environ[source.world_size]),
            config_path=config_path,
            stop_route="launcher",
            in_place=True,
        )
    kind = launcher_kind(config.launcher)
    pool = resource_pool(config, environ, local_devices)
    inputs = PlanInputs(
        config=config,
        logging=logging,
        master_port_given=master_port_chosen(config, provenance),
        user_script=user_script,
        config_path=config_path,
        environ=environ,
        pool=pool,
        active=select_active(config, pool),
        python=python,
    )
    return kind.build(inputs)


def check_tools(plan: LaunchPlan, config: DeepSpeedRunnerArgs) -> None:
    """Every executable the launch needs exists here (a clear message, not a runner traceback)."""
    missing = [tool for tool in plan.tools if shutil.which(tool) is None]
    if missing:
        kind = launcher_kind(config.launcher)
        raise ConfigError(
            f"launcher={kind.name!r} ({kind.doc}) needs {', '.join(repr(t) for t in missing)} on PATH for "
            f"this {plan.mode} launch, and it is not installed here: install it, or pick another launcher"
        )
