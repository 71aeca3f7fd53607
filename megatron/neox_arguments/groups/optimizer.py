"""Optimizer choice and ZeRO shortcuts.

The peak learning rate and Adam hyperparameters normally arrive through the DeepSpeed-style
``optimizer`` block (see the DeepSpeed config group); these keys are the flat alternatives.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, not_supported

OptimizerType = Literal[
    "adam",
    "onebitadam",
    "cpu_adam",
    "cpu_torch_adam",
    "sm3",
    "madgrad_wd",
    "sgd",
    "lion",
]


class OptimizerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsOptimizer`` group."""

    optimizer_type: OptimizerType = "adam"
    """Optimizer family, picked from Deepy's optimizer registry (also settable through the
    DeepSpeed-style optimizer block)."""

    use_bnb_optimizer: bool = not_supported(False)
    """Use bitsandbytes' 8-bit Adam to shrink optimizer state."""

    zero_stage: int | list[int] | Literal["all"] | None = None
    """ZeRO stage (0-3) to use, a list of stages to try, or `all`; normally set inside
    zero_optimization."""

    zero_reduce_scatter: bool | None = None
    """ZeRO: reduce gradients with reduce-scatter instead of all-reduce."""

    zero_contiguous_gradients: bool | None = None
    """ZeRO: copy gradients into one contiguous buffer as produced, avoiding fragmentation."""

    zero_reduce_bucket_size: int | None = Field(None, ge=1)
    """ZeRO: number of elements reduced at once."""

    zero_allgather_bucket_size: int | None = Field(None, ge=1)
    """ZeRO: number of elements all-gathered at once."""

    lr: float | None = Field(None, ge=0)
    """Peak learning rate; normally read from optimizer.params.lr."""
