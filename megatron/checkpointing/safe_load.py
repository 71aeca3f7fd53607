"""Loading checkpoints without running pickled code.

Our own files hold only tensors, numbers and strings and are read with
``torch.load(weights_only=True)``. DeepSpeed 0.19.8 calls ``torch.load(..., weights_only=False)``
itself (engine, ZeRO, universal loader); torch's public switch ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
turns those calls into weights-only loads too, and ``torch.serialization.safe_globals`` allows
exactly the few DeepSpeed classes its optimizer files contain. A file that needs anything else
fails with a clear ``CheckpointError`` naming it instead of executing it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.errors import CheckpointError


def _deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed's own checkpoint files reference (checked on 0.19.8, ZeRO 0-2, UCP)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum, SubparamShape]


def load_trusted_tensors(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` for files made of tensors and plain containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} is missing") from err
    except Exception as err:  # noqa: BLE001 - torch raises several types for a bad file
        raise CheckpointError(f"cannot read {path} as a checkpoint file: {err}") from err


FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def weights_only_loading(directory: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Within the block every ``torch.load`` (DeepSpeed's included) is a weights-only load with
    DeepSpeed's allow-list; a refused file becomes a :class:`CheckpointError` naming it (searched
    for in ``directory``)."""
    previous = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"  # read by torch.load on every call
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError (or wraps it)
        if "Weights only load failed" not in str(err) and "Unsupported global" not in str(err):
            raise
        name, unsafe = _refused_file(directory)
        raise CheckpointError(
            f"refusing to load {name}: it contains pickled objects outside the allow-list "
            f"({', '.join(unsafe) or 'unknown'}); loading them could run arbitrary code"
        ) from err
    finally:
        if previous is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous


def _refused_file(directory: str | os.PathLike[str] | None) -> tuple[str, list[str]]:
    """The first file under ``directory`` holding globals outside the allow-list, for the message."""
    if directory is None:
        return "a checkpoint file", []
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _deepspeed_safe_globals()}
    for path in sorted(Path(directory).rglob("*.pt")):
        unsafe = [g for g in _unsafe_globals(path) if g not in allowed]
        if unsafe:
            return str(path), unsafe
    return f"a file in {directory}", []


def _unsafe_globals(f: Any) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:  # noqa: BLE001 - best effort for the message only
        return []
