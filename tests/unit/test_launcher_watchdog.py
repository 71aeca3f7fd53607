"""A rank of a local launch ends when the deepy.py that started it is killed (even by SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron.launcher.watchdog import ENV_VAR, launcher_environment, process_identity, start_launcher_watchdog

REPO = Path(__file__).resolve().parents[2]
RANK = "from megatron.launcher.watchdog import start_launcher_watchdog as s; import time; s(); time.sleep(60)"


def rank_watching(launcher: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    identity = process_identity(launcher.pid)
    assert identity is not None
    env = {**os.environ, ENV_VAR: identity, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", RANK], env=env)


def test_rank_dies_with_its_launcher() -> None:
    launcher = subprocess.Popen(["sleep", "60"])
    rank = rank_watching(launcher)
    time.sleep(1.5)
    assert rank.poll() is None  # the launcher lives: the rank runs on
    launcher.kill()
    launcher.wait()
    assert rank.wait(timeout=10) == -signal.SIGKILL


def test_identity_includes_the_start_time_so_a_reused_pid_does_not_count() -> None:
    me = process_identity(os.getpid())
    assert me is not None and me.startswith(f"{os.getpid()}:")
    assert launcher_environment() == {ENV_VAR: me}
    pid, start = me.split(":")
    stale = f"{pid}:{int(start) + 1}"  # same pid, another process
    rank = subprocess.Popen([sys.executable, "-c", RANK], env={**os.environ, ENV_VAR: stale, "PYTHONPATH": str(REPO)})
    assert rank.wait(timeout=20) == -signal.SIGKILL


def test_no_variable_no_watchdog() -> None:
    assert start_launcher_watchdog({}) is None
