"""Deepy's per-node launcher for a launch on this machine alone: one worker per slot, started with the
variables torch.distributed and DeepSpeed read; it waits for them and stops the rest when one fails.

    python -u -m megatron.launcher.local_ranks --slots 0,1 --master_port 29500 train.py --deepy_config PATH

Why not DeepSpeed's own per-node launcher (``deepspeed.launcher.launch``), which does the same for one
host: it imports DeepSpeed, and with it torch, before starting anything - about 2 s of a CPU's time on
every launch, to set a handful of variables, and then each worker imports them again. This module
imports only the standard library until it knows whether the workers are forked (below; the package's
``__init__`` imports nothing either). What each worker gets - the variables and its command
line ``python -u SCRIPT --local_rank=N ARGS`` - is what DeepSpeed's launcher gives it
(``tests/unit/test_launcher_cmd.py`` compares the two), so train.py and DeepSpeed see the same either
way. Launches across hosts (pdsh), or from a hostfile, still go through DeepSpeed's runner.

A stop request does not pass through here: deepy signals the ranks themselves (stop route ``ranks``).
A SIGTERM or SIGINT to this process ends the workers, as DeepSpeed's launcher does.

**Forked ranks (machines without a GPU driver).** Every rank of a CPU launch used to import the same
torch, TorchDynamo (torch's optimizers import it on their first step), DeepSpeed and Deepy modules:
about 4 s of a core's time each, most of a small run's cost. Where no GPU driver is installed
(``megatron.devices.gpu_driver_present``), this launcher imports torch, TorchDynamo and DeepSpeed
once (:data:`PRELOAD`; no thread is started and no tensor op runs) and forks one worker per slot,
which runs the script as ``python -u SCRIPT --local_rank=N ARGS`` would (``runpy``, the same
``sys.argv``, environment and ``sys.path[0]``) and is named ``deepy-rank<N>`` (``ps``,
``/proc/<pid>/comm``). Where a driver is installed, or DeepSpeed's accelerator is not the CPU once
imported (:func:`preload`), workers are started fresh as above: a device context must never be
forked, and a GPU job's start-up does not hinge on 4 s. ``DEEPY_FORK_RANKS=0`` starts them fresh on
CPU too.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import NoReturn, Protocol

from megatron.devices import gpu_driver_present
from megatron.logging.heartbeats import HANG_EXIT_CODE  # standard library only
from megatron.logging.rank_errors import record_exit

FORK_RANKS_ENV = "DEEPY_FORK_RANKS"
PRELOAD = ("torch", "torch._dynamo", "deepspeed")
"""What every rank of train.py, generate.py and eval.py imports, ~85 % of its imports' time. Deepy's own
modules (the rest) are left to the script: the launcher sits below the trainer and names nothing above it."""
RANK_NAME_PREFIX = "deepy-rank"
"""A forked worker's process name (``/proc/<pid>/comm``) is this and its local rank: its command line is
this launcher's, so ``processes.rank_processes`` finds it by the name."""
POLL_S = 0.05
STACKS_WAIT_S = 2.0
"""How long the ranks still running get to write their stacks once the run hung."""
GRACE_S = 10.0
"""How long a worker gets to exit after SIGTERM before SIGKILL, once another one has failed."""


def rank_environment(environ: Mapping[str, str], slots: Sequence[int], local_rank: int, master_addr: str,
                     master_port: int) -> dict[str, str]:  # fmt: skip
    """The environment of the worker on ``slots[local_rank]``: one node, every slot of it a rank.

    Slots are device ids, as DeepSpeed's launcher sets them. Where this machine names its visible
    devices by UUID or MIG instance (not ids), slot ``i`` is the ``i``-th of them: writing ``0,1`` there
    would hand the ranks the whole first GPUs instead."""
    listed = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    by_name = listed and not all(entry.isdigit() for entry in listed) and max(slots) < len(listed)
    devices = [listed[s] for s in slots] if by_name else [str(s) for s in slots]
    return {
        **environ,
        # DeepSpeed's CUDA and CPU accelerators both name the visible devices this way
        "CUDA_VISIBLE_DEVICES": ",".join(devices),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(len(slots)),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "LOCAL_SIZE": str(len(slots)),
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
    }


def rank_command(python: str, script: str, local_rank: int, script_args: Sequence[str]) -> list[str]:
    return [python, "-u", script, f"--local_rank={local_rank}", *script_args]


class Worker(Protocol):
    """A started rank: a ``subprocess.Popen`` or a :class:`ForkedRank`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ForkedRank:
    """A worker forked from this launcher, with the part of ``Popen``'s interface the supervision uses
    (exit codes as ``Popen`` reports them: negative for a signal)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def fork_ranks_here(environ: Mapping[str, str]) -> bool:
    """Fork the workers (after :func:`preload`) rather than start fresh interpreters: no GPU driver."""
    return environ.get(FORK_RANKS_ENV, "1") != "0" and not gpu_driver_present()


def preload() -> bool:
    """Import :data:`PRELOAD`; whether DeepSpeed then runs on the CPU, so the workers may be forked.

    No NVIDIA or AMD driver does not mean no accelerator: DeepSpeed also drives Intel XPUs, Habana HPUs
    and others, whose runtimes its import may start (and a started device runtime must not be forked).
    Then the workers start fresh, as on a GPU machine."""
    for name in PRELOAD:
        importlib.import_module(name)
    # lazy: DeepSpeed is imported on purpose here, by preload(), before the ranks fork
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().device_name() == "cpu")


def fork_rank(script: str, local_rank: int, script_args: Sequence[str], env: Mapping[str, str]) -> ForkedRank:
    """Fork a worker that runs ``script`` as ``python -u SCRIPT --local_rank=N ARGS`` would."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    _run_script(script, [f"--local_rank={local_rank}", *script_args], env, f"{RANK_NAME_PREFIX}{local_rank}")


def _run_script(script: str, args: Sequence[str], env: Mapping[str, str], name: str) -> NoReturn:
    """The forked worker: the script as ``__main__``, then the interpreter's exit without its teardown
    of the launcher's state (``os._exit``, after the script's ``atexit`` functions, as an exit would)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        try:
            with open("/proc/self/comm", "w") as comm:
                comm.write(name)
        except OSError:
            pass
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts first
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (the interpreter's own report of an uncaught error)
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def stop_all(processes: Sequence[Worker], grace_s: float = GRACE_S) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def describe_end(returncode: int) -> str:
    """``killed by signal 9 (SIGKILL: out of memory?)`` or ``exited with code 3``, for a Popen return code."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    oom = ": out of memory?" if returncode == -signal.SIGKILL else ""  # the kernel's OOM killer sends SIGKILL
    return f"killed by signal {-returncode} ({name}{oom})"


def supervise(processes: Sequence[Worker], run_dir: str | None = None) -> int:
    """Wait for every worker (``processes[r]`` is rank ``r``); the first non-zero exit ends the others and
    is the result. Ranks that failed are said with their rank and host, and recorded in ``run_dir``'s
    errors (:func:`megatron.logging.rank_errors.record_exit`) with the last moment each was seen
    running, so that deepy names the rank that failed first as the cause, not a peer whose collective
    it broke."""
    rank_of = {proc.pid: rank for rank, proc in enumerate(processes)}
    alive_at = dict.fromkeys(rank_of, time.time())
    running = list(processes)
    while running:
        failed = []
        for proc in list(running):
            looked = time.time()
            code = proc.poll()
            if code is None:
                alive_at[proc.pid] = looked
                continue
            running.remove(proc)
            if code != 0:
                failed.append((proc, code))
        for proc, code in failed:  # every rank found dead in this look, before the others are stopped
            rank = rank_of[proc.pid]
            print(f"deepy: rank {rank} (pid {proc.pid} on host {socket.gethostname()}) {describe_end(code)}; "
                  f"stopping the others", file=sys.stderr, flush=True)  # fmt: skip
            if run_dir is not None:
                record_exit(run_dir, rank, proc.pid, code, alive_at[proc.pid])
        if failed:
            if any(code == HANG_EXIT_CODE for _, code in failed):
                ask_for_stacks(running)
            stop_all(running)
            code = failed[0][1]
            return code if code > 0 else 128 - code
        time.sleep(POLL_S)
    return 0


def ask_for_stacks(processes: Sequence[Worker], wait_s: float = STACKS_WAIT_S) -> None:
    """The run hung (a rank ended with the hang code): have every rank still running write its Python stacks
    (SIGUSR2: ``megatron/training/hang_watch.py``) before it is stopped; SIGCONT after it, so that a stopped rank
    takes the signal too."""
    for proc in processes:
        if proc.poll() is None:
            for signum in (signal.SIGUSR2, signal.SIGCONT):
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass
    if processes:
        time.sleep(wait_s)  # faulthandler writes from the signal handler itself: well within this


def run_directory(script_args: Sequence[str]) -> str | None:
    """The run directory of the workers' ``--deepy_config <run_dir>/deepy_config.json``, if they name one."""
    args = list(script_args)
    path = next((b for a, b in zip(args, args[1:]) if a == "--deepy_config"), None)
    return os.path.dirname(os.path.abspath(path)) if path else None


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", required=True, help="device ids of this machine, comma-separated (one rank each)")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(sys.argv[1:] if argv is None else argv)
    slots = [int(s) for s in options.slots.split(",")]
    processes: list[Worker] = []

    def on_stop(signum: int, _frame: object) -> None:
        stop_all(processes)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    forked = fork_ranks_here(os.environ) and preload()
    for local_rank in range(len(slots)):
        env = rank_environment(os.environ, slots, local_rank, options.master_addr, options.master_port)
        if forked:
            processes.append(fork_rank(options.script, local_rank, options.script_args, env))
        else:
            cmd = rank_command(sys.executable, options.script, local_rank, options.script_args)
            processes.append(subprocess.Popen(cmd, env=env))
    return supervise(processes, run_directory(options.script_args))


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as stopped:
        status = stopped.code if isinstance(stopped.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    # nothing of ours is left to run; with torch and DeepSpeed preloaded, the interpreter's teardown
    # would take another ~1.5 s of every launch
    os._exit(status)
