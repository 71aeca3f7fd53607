"""``train.py`` with faults injected at chosen steps, for the restart and hang tests: ``DEEPY_FAULTS`` lists
``ACTION:RANK:STEP`` (comma-separated), ACTION ``kill`` (the rank sends itself SIGKILL, as a machine failure or the
out-of-memory killer would) or ``stop`` (SIGSTOP: a hang that nothing inside the rank can notice), at the start of
0-based-counted step STEP (1-based: after STEP - 1 steps are finished). Each fault fires once per run directory
(a marker file under ``DEEPY_FAULT_MARKERS``), so the relaunch of ``max_restarts`` trains through; ``ACTION!``
fires on every launch. ``slow:RANK:SECONDS`` makes RANK wait SECONDS for each of its micro-batches, on every step
(a slow data loader: a straggler).

The seam is the training loop's ``train_step`` of this test script's own process (Deepy's code, not torch's).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import megatron.training.loop as loop  # noqa: E402
from megatron.training import hang_watch  # noqa: E402
from train import run_worker  # noqa: E402

FAULTS = [spec.split(":") for spec in os.environ.get("DEEPY_FAULTS", "").split(",") if spec]
MARKERS = Path(os.environ.get("DEEPY_FAULT_MARKERS", "."))
real_train_step = loop.train_step


def slowed(batches, seconds):  # type: ignore[no-untyped-def]
    for batch in batches:
        time.sleep(seconds)
        yield batch


def faulty_train_step(eng, micro_batches, device, *rest):  # type: ignore[no-untyped-def]
    watch = hang_watch.current()
    step = (watch.heartbeat.step if watch is not None else 0) + 1
    rank = os.environ.get("RANK")
    for number, (action, at_rank, at_step) in enumerate(FAULTS):
        if action == "slow" and rank == at_rank:
            micro_batches = slowed(micro_batches, float(at_step))
        if action == "slow" or rank != at_rank or step != int(at_step):
            continue
        marker = MARKERS / f"fault{number}-{action}-{at_rank}-{at_step}"
        if not action.endswith("!"):
            if marker.exists():
                continue
            marker.write_text(str(os.getpid()))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL if action.rstrip("!") == "kill" else signal.SIGSTOP)
    return real_train_step(eng, micro_batches, device, *rest)


loop.train_step = faulty_train_step

if __name__ == "__main__":
    run_worker()
