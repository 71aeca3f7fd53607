"""The processes of one launch on this machine: finding its ranks, signalling them, leaving none behind.

deepy starts the launch command in a session of its own, so every process of the run on this
machine (DeepSpeed's runner and per-node launcher, the ranks, their data-loader workers) shares
that session id even after a parent dies and it is re-parented. That makes two things reliable:
finding the ranks to pass a stop request to, and making sure nothing outlives deepy.
"""

from __future__ import annotations

import os
import signal

import psutil

from megatron.launcher.local_ranks import RANK_NAME_PREFIX
from megatron.launcher.plan import CONFIG_FLAG


def session_processes(session: int) -> list[psutil.Process]:
    """Live processes of ``session`` (the pid of the process deepy started), zombies excluded."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def names_config(cmdline: list[str], config_path: str) -> bool:
    return any(a == CONFIG_FLAG and b == config_path for a, b in zip(cmdline, cmdline[1:]))


def is_rank_cmdline(cmdline: list[str], config_path: str) -> bool:
    """A worker of this run: ``... SCRIPT [--local_rank=N] --deepy_config PATH``, not a launcher
    (DeepSpeed's runner or per-node launcher, deepy's ``local_ranks``, torchrun's agent) whose arguments end the
    same."""
    # every module of megatron/launcher/ started with -m is a launcher (local_ranks, torchrun's agent)
    if any(arg.startswith(("deepspeed.launcher", "megatron.launcher.")) or arg == "torch.distributed.run"
           for arg in cmdline):
        return False
    return names_config(cmdline, config_path)


def is_rank(proc: psutil.Process, config_path: str) -> bool:
    """A worker of this run: started as a worker's command line, or forked by deepy's ``local_ranks``
    (whose command line it keeps, under the process name ``deepy-rank<N>``)."""
    cmdline = proc.cmdline()
    if is_rank_cmdline(cmdline, config_path):
        return True
    return proc.name().startswith(RANK_NAME_PREFIX) and names_config(cmdline, config_path)


def rank_processes(session: int, config_path: str) -> list[psutil.Process]:
    """The ranks of the run: workers whose parent is not itself a worker (not data-loader children)."""
    workers: dict[int, psutil.Process] = {}
    for proc in session_processes(session):
        try:
            if is_rank(proc, config_path):
                workers[proc.pid] = proc
        except psutil.Error:
            continue
    ranks = []
    for pid, proc in workers.items():
        try:
            if proc.ppid() not in workers:
                ranks.append(proc)
        except psutil.Error:
            continue
    return sorted(ranks, key=lambda p: p.pid)


def survives(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches or ignores ``signum`` (``SigCgt``/``SigIgn`` in /proc/<pid>/status),
    rather than dying of its default action. False when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigCgt:", "SigIgn:"))]
    except (OSError, ValueError, IndexError):
        return False
    return any(mask >> (signum - 1) & 1 for mask in masks)


def send(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def end_session(session: int, grace_s: float = 10.0) -> list[str]:
    """SIGTERM every remaining process of ``session``, SIGKILL what is left after ``grace_s``.

    Returns a description of the processes found, for the message that says so.
    """
    left = session_processes(session)
    if not left:
        return []
    described = []
    for proc in left:
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    return described

