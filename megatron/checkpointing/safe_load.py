"""Loading checkpoints without running pickled code, and without touching process-wide state.

Our own reads (:func:`load_checkpoint_file`, :func:`load_trusted_tensors`) pass
``torch.load(weights_only=True)``: files made of tensors, numbers and strings, plus the few DeepSpeed
classes its files reference, allowed for that call with ``torch.serialization.safe_globals``.

DeepSpeed 0.19.8 calls ``torch.load(..., weights_only=False)`` itself (engine, ZeRO, universal loader,
``ds_to_universal``), and torch 2.13 offers no call-scoped way to override an explicit
``weights_only=False``: only the process-wide ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` environment variable,
which every thread and every child started meanwhile would see. So :func:`weights_only_loading`
checks the files instead: before DeepSpeed reads a checkpoint, every ``*.pt`` file under it is read
once with torch's weights-only unpickler and the same allow-list (``mmap``: the tensor bytes stay on
disk), and a file that needs anything else fails with a clear ``CheckpointError`` naming it, before
DeepSpeed unpickles a byte of it. (What the check cannot see is a file swapped between the check and
DeepSpeed's read: that needs write access to the checkpoint while it is being loaded.)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.errors import CheckpointError


def _deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed's own checkpoint files reference (checked on 0.19.8, ZeRO 0-2, UCP)."""
    # lazy: DeepSpeed's classes, only to read its own files; offline readers run without it
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


def load_checkpoint_file(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` of one checkpoint file (ours or DeepSpeed's) with DeepSpeed's allow-list; a file
    that holds pickled code or cannot be parsed becomes a :class:`CheckpointError` naming it."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        if not _is_file_problem(err):
            raise
        raise _explain(err, path) from err


@contextlib.contextmanager
def weights_only_loading(source: str | os.PathLike[str]) -> Iterator[None]:
    """DeepSpeed may read the checkpoint at ``source`` (its directory, or one file) within the block.

    Every ``*.pt`` file under ``source`` passes a weights-only read with DeepSpeed's allow-list first
    (see the module docstring for why the files are checked rather than DeepSpeed's own loads made
    weights-only); one holding pickled code is refused, one torch cannot parse (truncated,
    overwritten, bit-flipped) is reported as corrupt, both as a :class:`CheckpointError` naming it.
    A file problem DeepSpeed meets inside the block is explained the same way.
    """
    _check_files(source)
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            yield
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        if not _is_file_problem(err):
            raise
        raise _explain(err, source) from err


def _checkpoint_files(source: str | os.PathLike[str]) -> list[Path]:
    root = Path(source)
    return [root] if root.is_file() else sorted(root.rglob("*.pt"))


def _check_files(source: str | os.PathLike[str]) -> None:
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for path in _checkpoint_files(source):
            try:
                # mmap needs torch's zip format; a file without it is read whole (and fails if corrupt)
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except Exception as err:  # noqa: BLE001 - any failure means DeepSpeed must not unpickle it
                raise _explain(err, source) from err


def _is_file_problem(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, (pickle.UnpicklingError, EOFError)) or any(
        marker in text for marker in ("Weights only load failed", "Unsupported global", "PytorchStreamReader",
                                      "zip archive", "central directory", "invalid load key")
    )


def _explain(err: BaseException, source: str | os.PathLike[str]) -> CheckpointError:
    """Which file under ``source`` could not be read, and why."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in _deepspeed_safe_globals()}
    files = _checkpoint_files(source)
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
    return CheckpointError(f"a checkpoint file in {source} cannot be read: {type(err).__name__}: {str(err)[:300]}")


def _unsafe_globals(f: Any) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:  # noqa: BLE001 - best effort for the message only
        return []
