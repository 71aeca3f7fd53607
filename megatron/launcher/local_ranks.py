"""Deepy's per-node launcher for a launch on this machine alone: one worker per slot, started with the
variables torch.distributed and DeepSpeed read; it waits for them and stops the rest when one fails.

    python -u -m megatron.launcher.local_ranks --slots 0,1 --master_port 29500 train.py --deepy_config PATH

Why not DeepSpeed's own per-node launcher (``deepspeed.launcher.launch``), which does the same for one
host: it imports DeepSpeed, and with it torch, before starting anything - about 2 s of a CPU's time on
every launch, to set a handful of variables. This module needs the standard library only (the
package's ``__init__`` imports nothing either). What each worker gets - the variables and its command
line ``python -u SCRIPT --local_rank=N ARGS`` - is what DeepSpeed's launcher gives it
(``tests/unit/test_launcher_cmd.py`` compares the two), so train.py and DeepSpeed see the same either
way. Launches across hosts (pdsh), or from a hostfile, still go through DeepSpeed's runner.

A stop request does not pass through here: deepy signals the ranks themselves (stop route ``ranks``).
A SIGTERM or SIGINT to this process ends the workers, as DeepSpeed's launcher does.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

POLL_S = 0.05
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


def stop_all(processes: Sequence[subprocess.Popen[bytes]], grace_s: float = GRACE_S) -> None:
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


def supervise(processes: Sequence[subprocess.Popen[bytes]]) -> int:
    """Wait for every worker; the first non-zero exit ends the others and is the result."""
    running = list(processes)
    while running:
        for proc in list(running):
            code = proc.poll()
            if code is None:
                continue
            running.remove(proc)
            if code != 0:
                print(f"deepy: rank process {proc.pid} exited with code {code}; stopping the others",
                      file=sys.stderr, flush=True)  # fmt: skip
                stop_all(running)
                return code if code > 0 else 128 - code
        time.sleep(POLL_S)
    return 0


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
    processes: list[subprocess.Popen[bytes]] = []

    def on_stop(signum: int, _frame: object) -> None:
        stop_all(processes)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    for local_rank in range(len(slots)):
        env = rank_environment(os.environ, slots, local_rank, options.master_addr, options.master_port)
        cmd = rank_command(sys.executable, options.script, local_rank, options.script_args)
        processes.append(subprocess.Popen(cmd, env=env))
    return supervise(processes)


if __name__ == "__main__":
    sys.exit(main())
