"""A stop request that reaches a training rank while it is still starting: the rank ends, cleanly.

A rank takes stop requests (SIGTERM, SIGUSR1) through :class:`megatron.checkpointing.preemption.PreemptionWatcher`
once its checkpointing is set up, before its first step: it finishes the step, saves and exits 0. Until then the
signals' default action would kill it - "the ranks ended with exit code 138" where ``srun`` or ``mpirun`` pass a
stop request on to ranks that are still importing torch or waiting for the rendezvous (deepy's own launcher on
one machine also waits for the ranks to catch the signal, ``megatron/launcher/run.py``). So ``train.py`` installs
:func:`catch_until_training` first thing: a request before the watcher's handlers replace it ends the rank with
exit code 0 at once and one line (rank 0's) that nothing was trained or saved, which is so: no step has run. Under a
scheduler every rank gets the request, so they all end; a rank inside a blocking call (the rendezvous) takes it
when the call returns. Standard library only: it is installed before the heavy imports.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
"""The stop requests a rank takes (the preemption watcher's too)."""


def catch_until_training(rank: int | None) -> None:
    """Until the preemption watcher takes over, a stop request ends this rank with exit code 0 (``rank`` 0, or an
    unknown rank, says so)."""

    def stop_before_start(signum: int, _frame: FrameType | None) -> None:
        if rank in (0, None):
            print(f"deepy: {signal.Signals(signum).name} while the ranks were starting: stopping before the run "
                  "began; nothing was trained or saved, nothing is lost", file=sys.stderr, flush=True)
        # at once, as the signal's default action would, but with exit code 0: the request may come in the middle
        # of an import of torch's or DeepSpeed's extensions, and unwinding from there (SystemExit, then the
        # interpreter's teardown of half-made modules) crashed a rank with SIGSEGV; nothing needs closing yet
        os._exit(0)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_before_start)
