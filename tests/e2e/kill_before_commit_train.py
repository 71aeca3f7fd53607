"""``train.py`` with the crash-safety seam: rank 0 dies by SIGKILL after checkpoint STEP's files are
written and before its commit marker, as a machine failure (or the kernel's out-of-memory killer) at the
worst moment would: rank 0 is the one that commits, and its peers fail in the collective that follows.

STEP comes from ``KILL_BEFORE_COMMIT_STEP`` in the environment (read here, by the test's own user
script; the trainer only sees the injected callback).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train import run_worker  # noqa: E402

STEP = int(os.environ["KILL_BEFORE_COMMIT_STEP"])


def kill_at(step: int) -> None:
    if step == STEP and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    run_worker(before_commit=kill_at)
