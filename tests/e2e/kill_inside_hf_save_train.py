"""``train.py`` with the HF saves' crash-safety seam: the writing rank dies by SIGKILL inside the HF save of 0-based
step STEP, its files written into the directory beside its place and not yet renamed in, as a machine failure at
the worst moment would.

STEP comes from ``KILL_INSIDE_HF_SAVE_STEP`` in the environment (read here, by the test's own script; the trainer
only sees the injected writer, which wraps the real one).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train import run_worker  # noqa: E402

STEP = int(os.environ["KILL_INSIDE_HF_SAVE_STEP"])


def killing_writer(*args: Any) -> Any:
    from megatron.interop.hf_save_writer import HFModelWriter

    inner = HFModelWriter(*args)

    def write(weights: Mapping[str, Any], out_dir: Path) -> None:
        inner(weights, out_dir)
        if out_dir.name.startswith(f".step-{STEP}."):
            os.kill(os.getpid(), signal.SIGKILL)

    return write


if __name__ == "__main__":
    run_worker(hf_writer=killing_writer)
