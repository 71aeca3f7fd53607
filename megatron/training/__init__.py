"""The trainer: ``pretrain(args)``, the loop, optimizers and LR schedules from config registries.

``pretrain`` is imported lazily so ``megatron.training.lr_schedules`` and friends stay cheap to
import (no DeepSpeed engine) for tools and unit tests.
"""

from __future__ import annotations

from typing import Any


def pretrain(args: Any) -> Any:
    from megatron.training.pretrain import pretrain as _pretrain

    return _pretrain(args)


__all__ = ["pretrain"]
