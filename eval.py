"""Evaluation with lm-evaluation-harness, started on every rank by deepy.py:
``python deepy.py eval.py CONFIGS... eval_tasks=[TASK_OR_YAML,...]``.

The weights come from the newest committed checkpoint in ``load``; results go to
``<eval_results_prefix>_eval_results.json`` and ``<log_dir>/metrics.jsonl``. Thin on purpose:
see megatron/evaluation/.
"""

from __future__ import annotations

import sys

from megatron.app.workers import eval_main
from megatron.errors import run_guarded


def main() -> int:
    return eval_main(sys.argv[1:])


if __name__ == "__main__":
    from megatron.logging.console import quiet_other_ranks
    from megatron.logging.rank_errors import current_rank, for_worker

    quiet_other_ranks(current_rank())  # one rank draws progress bars (lm-eval's among them)

    try:
        # an error every rank hits is printed once (megatron/logging/rank_errors.py)
        run_guarded(main, report=for_worker(sys.argv, current_rank))
    except SystemExit as done:
        from megatron.initialize import exit_process

        exit_process(done.code)
