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

    def safe_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        kwargs.setdefault("map_location", "cpu")
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, *args, **kwargs)
            except Exception as err:  # noqa: BLE001
                if "Weights only load failed" in str(err) or "Unsupported global" in str(err):
                    name = Path(f).name if isinstance(f, (str, os.PathLike)) else repr(f)
                    unsafe = _unsafe_globals(f)
                    raise CheckpointError(
                        f"refusing to load {name}: it contains pickled objects outside the allow-list "
                        f"({', '.join(unsafe) or 'unknown'}); loading them could run arbitrary code"
                    ) from err
                raise

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
