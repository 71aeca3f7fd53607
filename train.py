"""Worker entry point, on every rank: ``train.py --deepy_config PATH`` (started by deepy.py), or
``train.py CONFIG... [key=value ...]`` started by torchrun or DeepSpeed's runner without deepy.py, where each
worker resolves and checks the config itself (megatron/app/external_launch.py).

Thin on purpose: read the resolved config, build the typed run config, join the job, then hand
over to megatron/.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron.checkpointing.stop_request import catch_until_training
from megatron.errors import run_guarded
from megatron.logging.console import is_verbose, quiet_other_ranks
from megatron.logging.rank_errors import current_rank, for_worker
from megatron.training import hang_watch

if TYPE_CHECKING:
    from megatron.app.external_launch import ErrorReport
    from megatron.launcher.save_lock import SaveLock
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.hf_saves import HFWriterFactory


EPILOG = """\
without deepy.py, under torchrun (one launcher per node, as on Kubernetes or SkyPilot):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py CONFIG... [key=value ...]
or DeepSpeed's runner on each node (no ssh):
  deepspeed --no_ssh --node_rank K --hostfile HOSTFILE --master_addr HOST train.py CONFIG... [key=value ...]
Every worker resolves and checks the config as deepy.py does, and the ranks agree on it before training."""


def names_resolved_config(argv: list[str]) -> bool:
    """The command line is deepy.py's ``--deepy_config PATH`` (or asks for help), not config files."""
    return any(a in ("--deepy_config", "-h", "--help") or a.startswith("--deepy_config=") for a in argv)


def parse_worker_argv(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Deepy worker (started by deepy.py on each rank)", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepy_config", required=True, help="resolved config written by deepy.py")
    # DeepSpeed's launcher appends --local_rank=N; the rank comes from the environment instead
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


def main(before_commit: Callable[[int], None] | None = None, hf_writer: HFWriterFactory | None = None,
         report: ErrorReport | None = None) -> int:
    """``before_commit``: a test seam passed through to the checkpointing (see pretrain); ``hf_writer``: a test
    seam in place of the HF saves' writer (the crash-safety tests wrap the real one and kill the rank inside it);
    ``report``: the error report of a worker started with config files (it learns the run directory)."""
    argv = sys.argv[1:]
    if names_resolved_config(argv):
        config_path = parse_worker_argv(argv).deepy_config  # first: --help needs none of the imports below
    else:
        # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
        from megatron.app.external_launch import ErrorReport as Report
        from megatron.app.external_launch import start

        started = start(sys.argv[0], argv, report or Report(0, 0))
        if started is None:
            return 0
        config_path = started.config_path
        global _lock
        _lock = started.lock
    return train(config_path, before_commit, hf_writer)


_lock: SaveLock | None = None
"""``save``'s lock, held by rank 0 of a worker started with config files (deepy.py holds it otherwise)."""


def train(config_path: str, before_commit: Callable[[int], None] | None, hf_writer: HFWriterFactory | None) -> int:
    # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
    from megatron.initialize import initialize
    from megatron.neox_arguments import load_resolved
    from megatron.neox_arguments.run_config import RunConfig

    run = RunConfig.from_resolved(load_resolved(config_path))
    watch_for_hangs(run, config_path)
    # each rank's place in the layout, with deepy.py --verbose (the run's header states the layout)
    initialize(run.parallel, run.training.seed, announce=is_verbose(run.logging.deepspeed_log_level),
               timeout_seconds=run.hang.init_timeout_seconds)

    # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
    from megatron.evaluation.in_training import TasksInTraining
    from megatron.training.pretrain import pretrain

    tasks = None if run.tasks is None else TasksInTraining(run.tasks)  # eval_tasks: lm-eval at evaluations
    if run.hf_saves.hf_save_path is not None and hf_writer is None:  # HF directories while training: the exporter's
        # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
        from megatron.interop.hf_save_writer import HFModelWriter

        hf_writer = HFModelWriter
    pretrain(run, run.checkpoint, before_commit=before_commit, task_evaluation=tasks, hf_writer=hf_writer)
    return 0


def watch_for_hangs(run: RunConfig, config_path: str) -> None:
    """This rank's heartbeat and hang watch (megatron/training/hang_watch.py), from before the rendezvous on."""
    rank = current_rank()
    if rank is None:
        return
    startup, steady = run.hang.hang_limits()
    hang_watch.start(os.path.dirname(os.path.abspath(config_path)), rank, startup_limit_s=startup, limit_s=steady,
                     train_timeout_s=run.hang.train_timeout_seconds)


def run_worker(before_commit: Callable[[int], None] | None = None, hf_writer: HFWriterFactory | None = None) -> None:
    catch_until_training(current_rank())  # first: a stop request while starting ends the rank cleanly

    quiet_other_ranks(current_rank())  # one rank draws progress bars (lm-eval's among them)

    report = for_worker(sys.argv, current_rank)
    external = None
    if not names_resolved_config(sys.argv[1:]):  # config files: started by torchrun or DeepSpeed's runner
        # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
        from megatron.app.external_launch import ErrorReport as Report

        external = Report(int(os.environ.get("LOCAL_RANK", "0") or 0), current_rank() or 0)
    try:
        # an error every rank hits is printed once (megatron/logging/rank_errors.py)
        run_guarded(lambda: main(before_commit, hf_writer, external), report=report or external)
    except SystemExit as done:
        # lazy: the schema (~0.5 s), torch and DeepSpeed load after --help and a stop request are handled
        from megatron.initialize import exit_process

        if _lock is not None:
            _lock.release()
        exit_process(done.code)


if __name__ == "__main__":
    run_worker()
