"""``train.py`` with a test seam that damages the weights of checkpoint STEP after they are written
and before the checkpoint is committed (a silent disk or filesystem fault).
``checkpoint_validation_with_forward_pass`` must notice it.

STEP comes from ``CORRUPT_STEP`` in the environment; the checkpoint directory is ``ckpt`` in the
working directory (read here, in the test's user script).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train import run_worker  # noqa: E402

STEP = int(os.environ["CORRUPT_STEP"])


def corrupt(step: int) -> None:
    if step != STEP or (dist.is_initialized() and dist.get_rank() != 0):
        return
    # plain engines keep the weights under "module" in mp_rank_*; pipelines one file per layer
    for path in sorted((Path("ckpt") / f"global_step{step}").glob("*model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        weights = state.get("module", state)
        names = [k for k in weights if k.endswith("word_embeddings.weight")]
        for name in names:
            weights[name] = weights[name] * 1.5
        if names:
            torch.save(state, path)
            return
    raise AssertionError("no embedding weights found to corrupt")


if __name__ == "__main__":
    run_worker(before_commit=corrupt)
