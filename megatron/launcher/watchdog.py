"""A rank of a local launch stops when the deepy.py that launched it is killed.

deepy.py starts the launcher in a session of its own (so Ctrl-C and stop signals go through deepy,
which relays them), and DeepSpeed's runner and per-node launcher do not pass a hard kill of deepy on
to the ranks. Without this guard a ``kill -9`` of deepy (an OOM killer, a crashing shell, a test
harness) would leave the ranks training on as orphans, still writing checkpoints into the directory
the next run resumes from. Nothing can catch SIGKILL, so each rank watches instead: deepy puts its
pid (and its start time, against pid reuse) in the ranks' environment for local launches, and a
daemon thread ends the rank at once when that process is gone - as if it had been killed with it,
so the committed checkpoints are what a resume finds. Launches across hosts (pdsh, Slurm, MPI) have
their own supervisors and do not set the variable.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

ENV_VAR = "DEEPY_LAUNCHER_PROCESS"
POLL_S = 0.5


def process_identity(pid: int) -> str | None:
    """``"<pid>:<start time in clock ticks>"`` from /proc, or None where there is no /proc entry."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields after its last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    return f"{pid}:{fields[19]}"  # field 22, starttime


def launcher_environment() -> dict[str, str]:
    """What deepy adds to a local launch's environment so the ranks can watch it."""
    identity = process_identity(os.getpid())
    return {ENV_VAR: identity} if identity is not None else {}


def start_launcher_watchdog(environ: Mapping[str, str] = os.environ) -> threading.Thread | None:
    """Watch the launching deepy named in ``environ``; kill this rank when it is gone."""
    identity = environ.get(ENV_VAR)
    if not identity or ":" not in identity:
        return None
    pid = int(identity.split(":", 1)[0])
    if process_identity(pid) != identity:  # already gone before this rank got here
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while process_identity(pid) == identity:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="deepy-launcher-watchdog", daemon=True)
    thread.start()
    return thread
