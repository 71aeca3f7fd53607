"""Worker entry point, started on every rank by deepy.py: ``train.py --deepy_config PATH``.

Thin on purpose: read the resolved config, build the typed run config, join the job, then hand
over to megatron/.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron.errors import run_guarded

if TYPE_CHECKING:
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.hf_saves import HFWriterFactory


def parse_worker_argv(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Deepy worker (started by deepy.py on each rank)")
    parser.add_argument("--deepy_config", required=True, help="resolved config written by deepy.py")
    # DeepSpeed's launcher appends --local_rank=N; the rank comes from the environment instead
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


def main(before_commit: Callable[[int], None] | None = None, hf_writer: HFWriterFactory | None = None) -> int:
    """``before_commit``: a test seam passed through to the checkpointing (see pretrain); ``hf_writer``: a test
    seam in place of the HF saves' writer (the crash-safety tests wrap the real one and kill the rank inside it)."""
    options = parse_worker_argv(sys.argv[1:])  # first: --help needs none of the imports below

    from megatron.initialize import initialize
    from megatron.logging.console import is_verbose
    from megatron.neox_arguments import load_resolved
    from megatron.neox_arguments.run_config import RunConfig

    run = RunConfig.from_resolved(load_resolved(options.deepy_config))
    watch_for_hangs(run, options.deepy_config)
    # each rank's place in the layout, with deepy.py --verbose (the run's header states the layout)
    initialize(run.parallel, run.training.seed, announce=is_verbose(run.logging.deepspeed_log_level),
               timeout_seconds=run.hang.init_timeout_seconds)

    from megatron.evaluation.in_training import TasksInTraining
    from megatron.training.pretrain import pretrain

    tasks = None if run.tasks is None else TasksInTraining(run.tasks)  # eval_tasks: lm-eval at evaluations
    if run.hf_saves.hf_save_path is not None and hf_writer is None:  # HF directories while training: the exporter's
        from megatron.interop.hf_save_writer import HFModelWriter

        hf_writer = HFModelWriter
    pretrain(run, run.checkpoint, before_commit=before_commit, task_evaluation=tasks, hf_writer=hf_writer)
    return 0


def watch_for_hangs(run: RunConfig, config_path: str) -> None:
    """This rank's heartbeat and hang watch (megatron/training/hang_watch.py), from before the rendezvous on."""
    import os

    from megatron.logging.rank_errors import current_rank
    from megatron.training import hang_watch

    rank = current_rank()
    if rank is None:
        return
    startup, steady = run.hang.hang_limits()
    hang_watch.start(os.path.dirname(os.path.abspath(config_path)), rank, startup_limit_s=startup, limit_s=steady,
                     train_timeout_s=run.hang.train_timeout_seconds)


def run_worker(before_commit: Callable[[int], None] | None = None, hf_writer: HFWriterFactory | None = None) -> None:
    from megatron.checkpointing.stop_request import catch_until_training
    from megatron.logging.rank_errors import current_rank

    catch_until_training(current_rank())  # first: a stop request while starting ends the rank cleanly

    from megatron.logging.console import quiet_other_ranks
    from megatron.logging.rank_errors import for_worker

    quiet_other_ranks(current_rank())  # one rank draws progress bars (lm-eval's among them)

    try:
        # an error every rank hits is printed once (megatron/logging/rank_errors.py)
        run_guarded(lambda: main(before_commit, hf_writer), report=for_worker(sys.argv, current_rank))
    except SystemExit as done:
        from megatron.initialize import exit_process

        exit_process(done.code)


if __name__ == "__main__":
    run_worker()
