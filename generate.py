"""Text generation, started on every rank by deepy.py: ``python deepy.py generate.py CONFIGS... [key=value ...]``.

``text_gen_type`` picks the mode (unconditional, input-file, interactive, precompute); the weights
come from the newest committed checkpoint in ``load``. Thin on purpose: see megatron/generation/.
"""

from __future__ import annotations

import sys

from megatron.app.workers import generate_main
from megatron.errors import run_guarded


def main() -> int:
    return generate_main(sys.argv[1:])


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
