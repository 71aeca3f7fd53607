"""Loading checkpoints without running pickled code.

Our own files hold only tensors, numbers and strings and are read with
``torch.load(weights_only=True)``. DeepSpeed 0.19.8 calls ``torch.load(..., weights_only=False)``
itself (engine, ZeRO, universal loader), so while it loads we swap ``torch.load`` for a version
that forces ``weights_only=True`` and allows exactly the few DeepSpeed classes its optimizer
files contain. A file that needs anything else fails with a clear ``CheckpointError`` instead of
executing it.
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


@contextlib.contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block every ``torch.load`` is a weights-only load with DeepSpeed's allow-list."""
    original = torch.load
    allowed = _deepspeed_safe_globals()
    allowed_names = {f"{c.__module__}.{c.__qualname__}" for c in allowed}

    def safe_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        kwargs.setdefault("map_location", "cpu")
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, *args, **kwargs)
            except (CheckpointError, FileNotFoundError):
                raise  # a missing file is DeepSpeed's to report (it probes for optional ones)
            except Exception as err:  # noqa: BLE001
                if not isinstance(f, (str, os.PathLike)):
                    raise
                unsafe = [name for name in _unsafe_globals(f) if name not in allowed_names]
                if unsafe:
                    raise CheckpointError(
                        f"refusing to load {Path(f).name} ({f}): it contains pickled objects outside the allow-list "
                        f"({', '.join(unsafe)}); loading them could run arbitrary code"
                    ) from err
                # anything else is a file torch cannot parse: truncated, overwritten, bit-flipped
                detail = str(err).splitlines()[0] if str(err) else ""
                if "Weights only load failed" in detail:  # torch's advice to unpickle blindly does not apply
                    detail = "not a torch checkpoint"
                raise CheckpointError(
                    f"checkpoint file {f} is corrupt or truncated and cannot be read ({type(err).__name__}: "
                    f"{detail[:160]}); restore it, or load another checkpoint (iteration: N)"
                ) from err

    torch.load = safe_load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = original  # type: ignore[assignment]


def _unsafe_globals(f: Any) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:  # noqa: BLE001 - best effort for the message only
        return []
