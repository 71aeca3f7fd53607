"""Random-number-generator state of one rank, as plain tensors and numbers.

Everything is converted to tensors, ints and lists so the file loads with
``torch.load(weights_only=True)``: no pickled numpy or Python objects, hence no code execution
from a checkpoint someone handed you.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RngState = dict[str, Any]


def _tp_rng_tracker() -> Any:
    """The tensor-parallel RNG tracker (dropout inside tensor-parallel regions draws from it)."""
    # imported here: megatron.mpu.random imports DeepSpeed, which readers of this module need not load
    from megatron.mpu.random import get_rng_tracker

    return get_rng_tracker()


def capture_rng_state() -> RngState:
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: RngState = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tp_tracker"] = dict(_tp_rng_tracker().get_states())
    return state


def restore_rng_state(state: RngState) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tp_tracker" in state:  # absent in checkpoints of runs that never seeded the tracker
        _tp_rng_tracker().set_states(state["tp_tracker"])
