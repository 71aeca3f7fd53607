"""Shared plumbing of the multi-rank tests: start N gloo ranks, collect one JSON result per rank.

Each rank runs its checks, records "ok" or the traceback per check, and leaves through
:func:`finish_rank`; the module fixture calls :func:`run_ranks` and parametrised tests assert on
the per-check results, so one spawn serves many named tests.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def record_checks(checks: Mapping[str, Callable[[], None]]) -> dict[str, str]:
    """Run every check on this rank: ``"ok"`` or its traceback per name (a failure does not stop the
    others, so every check still reports)."""
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


def run_tp_checks(rank: int, out_dir: str, world: int, checks: Mapping[str, Callable[[], None]]) -> None:
    """A rank of a pure tensor-parallel group of ``world`` gloo ranks: join, run ``checks``, report."""
    import faulthandler
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron.mpu import initialize_model_parallel

    faulthandler.enable()  # a native crash prints the Python stack
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    initialize_model_parallel(world, 1)
    finish_rank(out_dir, rank, record_checks(checks))


def join_data_parallel_ranks(rank: int, world: int, port_variable: str) -> None:
    """A rank of ``world`` pure data-parallel gloo ranks set up as train.py sets up a DeepSpeed rank: the address
    in the environment (the port from ``port_variable``), no shared-memory comm op, no Muon kernel compile, one
    thread, the process group and the model-parallel groups (tp 1, no pipeline)."""
    import os

    import torch
    import torch.distributed as dist

    from megatron.deepspeed_internals import defer_muon_kernel_compiles, skip_shared_memory_comm_op
    from megatron.mpu import initialize_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ[port_variable], RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    skip_shared_memory_comm_op()
    defer_muon_kernel_compiles()  # as train.py: ZeRO's Muon check without TorchInductor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    initialize_model_parallel(1, 0)


def finish_rank(out_dir: str, rank: int, results: dict[str, str]) -> None:
    """Write this rank's results, then leave without interpreter teardown (see exit_process)."""
    from megatron.initialize import exit_process

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    exit_process(0)


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "deepspeed", "megatron.mpu", "megatron.initialize"]
"""What every rank imports. The fork server (one per pytest process, started at its first use) imports
these once and forks each rank from itself - a fresh single-threaded interpreter that ran no tensor op,
as deepy's launcher forks ranks on CPU - so a start of N ranks no longer pays ~4 s of a CPU's imports
N times. TorchDynamo is among them, as in the launcher's ``local_ranks.PRELOAD``: every torch optimizer imports it
when it is built (~4 s of a CPU per rank otherwise). A preload that fails is skipped (multiprocessing's rule): the
rank imports it, as a spawned one would."""


def _in_environment(rank: int, rank_main: Callable[..., None], environ: dict[str, str], out: str) -> None:
    """A forked rank's environment is its server's, from when the server started: give it the caller's
    of now, as a spawned rank gets (tests pass ports and modes there)."""
    import os

    os.environ.clear()
    os.environ.update(environ)
    rank_main(rank, out)


def run_ranks(rank_main: Callable[..., None], world: int, out: Path, timeout_s: float = 300,
              start_method: str = "forkserver") -> list[dict[str, str]]:  # fmt: skip
    """Start ``rank_main(rank, str(out))`` on ``world`` new rank processes and return each rank's results.

    ``start_method="spawn"``: each rank a new interpreter of its own, for what is read at a process's
    start (``MALLOC_*`` variables) or measured from it (a resident-memory peak)."""
    if start_method == "forkserver":
        import os

        mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # effective when this process's server starts
        ctx = mp.start_processes(_in_environment, args=(rank_main, dict(os.environ), str(out)), nprocs=world,
                                 join=False, start_method="forkserver")  # fmt: skip
    else:
        ctx = mp.start_processes(rank_main, args=(str(out),), nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks did not finish in {timeout_s:.0f} s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
