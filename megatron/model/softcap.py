"""Gemma 2's soft cap of attention scores and output logits: ``c * tanh(x / c)`` (transformers 5.23.0
``models/gemma2/modeling_gemma2.py:195-198`` and ``518-521``, in that order of operations)."""

from __future__ import annotations

import torch


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``; ``x`` itself when ``cap`` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
