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
def weights_only_loading(source: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Within the block every ``torch.load`` (DeepSpeed's included) is a weights-only load with
    DeepSpeed's allow-list.

    A failed load becomes a :class:`CheckpointError` naming the file, looked up in ``source`` (the
    checkpoint directory being read, or the one file): one holding pickled code is refused, one
    torch cannot parse (truncated, overwritten, bit-flipped) is reported as corrupt.
    """
    previous = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"  # read by torch.load on every call
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        if not _is_file_problem(err):
            raise
        raise _explain(err, source) from err
    finally:
        if previous is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous


def _is_file_problem(err: BaseException) -> bool:
    import pickle

    text = str(err)
    return isinstance(err, (pickle.UnpicklingError, EOFError)) or any(
        marker in text for marker in ("Weights only load failed", "Unsupported global", "PytorchStreamReader",
                                      "zip archive", "central directory", "invalid load key")
    )


def _explain(err: BaseException, source: str | os.PathLike[str] | None) -> CheckpointError:
    """Which file under ``source`` could not be read, and why."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _deepspeed_safe_globals()}
    root = Path(source) if source is not None else None
    files = [] if root is None else ([root] if root.is_file() else sorted(root.rglob("*.pt")))
    for path in files:
        unsafe = [g for g in _unsafe_globals(path) if g not in allowed]
        if unsafe:
            return CheckpointError(
                f"refusing to load {path}: it contains pickled objects outside the allow-list "
                f"({', '.join(unsafe)}); loading them could run arbitrary code"
            )
    for path in files:
        try:
            with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as bad:  # noqa: BLE001
            detail = (str(bad).splitlines() or [""])[0]
            if "Weights only load failed" in detail:  # torch's advice to unpickle blindly does not apply
                detail = "not a torch checkpoint"
            return CheckpointError(
                f"checkpoint file {path} is corrupt or truncated and cannot be read ({type(bad).__name__}: "
                f"{detail[:160]}); restore it, or load another checkpoint (iteration: N)"
            )
    where = f" in {root}" if root is not None else ""
    return CheckpointError(f"a checkpoint file{where} cannot be read: {type(err).__name__}: {str(err)[:300]}")


def _unsafe_globals(f: Any) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:  # noqa: BLE001 - best effort for the message only
        return []
