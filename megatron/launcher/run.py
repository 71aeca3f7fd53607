"""Start the ranks of a resolved run and report how they ended.

The exit code of deepy.py is the exit code of the first failing rank: DeepSpeed's per-node
launcher stops the other ranks when one fails and exits with that rank's code, and its runner
passes it on. A rank killed by a signal reads as ``128 + signal``, as in a shell.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from megatron.errors import ConfigError
from megatron.launcher.command import LaunchPlan, plan_launch
from megatron.launcher.kinds import launcher_kind

# the directory holding the ``megatron`` package: workers outside the repo must still import it
REPO_ROOT = str(Path(__file__).resolve().parents[2])


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell would report it (signals -> 128 + signal number)."""
    return 128 - returncode if returncode < 0 else returncode


def worker_environment(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    return env


def check_backend(plan: LaunchPlan, args: Any) -> None:
    if plan.tool and shutil.which(plan.tool) is None:
        kind = launcher_kind(getattr(args, "launcher", None) or "pdsh")
        raise ConfigError(
            f"launcher={kind.name!r} needs '{plan.tool}' on PATH for a multi-node run ({kind.doc}), "
            f"and it is not installed here: install it, or pick another launcher"
        )


def launch(resolved: Any, user_script: str, config_path: str) -> int:
    """Start ``user_script --deepy_config config_path`` on every rank; return the run's exit code."""
    from megatron.neox_arguments.derived import active_resources

    args = resolved.args
    active = active_resources(args)
    plan = plan_launch(args, user_script, config_path, os.environ, active)
    check_backend(plan, args)
    world = sum(len(slots) for slots in active.values())
    print(f"deepy: starting {world} rank(s) via {plan.mode}: {shlex.join(plan.argv)}", flush=True)
    env = worker_environment({**os.environ, **plan.env})
    process = subprocess.Popen(plan.argv, env=env)

    def forward(signum: int, _frame: Any) -> None:
        # the runner tears its ranks down on SIGTERM/SIGINT; wait for it rather than orphan them
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = exit_code(returncode)
    if code != 0:
        print(f"deepy: run failed with exit code {code}", flush=True)
    return code
