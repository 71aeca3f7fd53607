"""Worker entry point, started on every rank by deepy.py: ``train.py --deepy_config PATH``.

Thin on purpose: read the resolved config, join the job, then hand over to megatron/.
"""

from __future__ import annotations

import argparse
import sys

from megatron.errors import run_guarded


def parse_worker_argv(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Deepy worker (started by deepy.py on each rank)")
    parser.add_argument("--deepy_config", required=True, help="resolved config written by deepy.py")
    # DeepSpeed's launcher appends --local_rank=N; the rank comes from the environment instead
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


def main() -> int:
    from megatron.initialize import initialize
    from megatron.neox_arguments import load_resolved

    options = parse_worker_argv(sys.argv[1:])
    resolved = load_resolved(options.deepy_config)
    initialize(resolved.args)  # prints this rank's coordinates

    from megatron.training import pretrain

    pretrain(resolved.args)
    return 0


if __name__ == "__main__":
    try:
        run_guarded(main)
    except SystemExit as done:
        from megatron.initialize import exit_process

        exit_process(done.code)
