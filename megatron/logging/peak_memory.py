"""Accelerator memory high-water marks, logged with every training row (``memory/...``).

Peak *allocated* memory is what the model, optimizer state and activations needed; *reserved* adds
the caching allocator's slack, which is what decides an out-of-memory. Both are since the start of
the process. Nothing is reported on a CPU (no allocator statistics to read).
"""

from __future__ import annotations

import torch


def memory_metrics() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    gib = float(2**30)
    return {
        "memory/max_allocated_gb": torch.cuda.max_memory_allocated() / gib,
        "memory/max_reserved_gb": torch.cuda.max_memory_reserved() / gib,
    }
