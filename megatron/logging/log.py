"""Console logging: one rank speaks, one line per logged step.

The speaking rank for training metrics is the one that holds the loss: global rank 0 without a
pipeline, the first rank of the last pipeline stage with one.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LOGGER_NAME = "deepy"
MODULES_LOGGER_NAME = "megatron"
"""Parent of the ``logging.getLogger(__name__)`` loggers of Deepy's modules."""


def setup_logging(speaks: bool, level: int = logging.INFO, verbose: bool = False) -> logging.Logger:
    """Configure the ``deepy`` logger (the run's lines) and the ``megatron`` modules' loggers.

    The speaking rank shows ``deepy`` at ``level`` and the modules' warnings; the other ranks show
    errors only, since in a data-parallel run they would repeat the speaking rank's lines word for word
    (``verbose``: their warnings too, and every module's info lines)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER_NAME)
    modules = logging.getLogger(MODULES_LOGGER_NAME)
    for each in (logger, modules):
        if not each.handlers:
            each.addHandler(handler)
            each.propagate = False
    quiet = logging.WARNING if verbose else logging.ERROR
    logger.setLevel(level if speaks else quiet)
    modules.setLevel((logging.INFO if verbose else logging.WARNING) if speaks else quiet)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


_FORMATS: list[tuple[str, str, str]] = [
    ("train/lm_loss", "loss", "{:.6f}"),
    ("eval/lm_loss", "eval loss", "{:.6f}"),
    ("test/lm_loss", "test loss", "{:.6f}"),
    ("train/rewards/accuracy", "reward accuracy", "{:.2f}"),  # DPO/KTO
    ("eval/rewards/accuracy", "eval reward accuracy", "{:.2f}"),
    ("train/rm/accuracy", "accuracy", "{:.2f}"),  # reward models
    ("eval/rm/accuracy", "eval accuracy", "{:.2f}"),
    ("train/lr", "lr", "{:.3e}"),
    ("train/loss_scale", "loss scale", "{:.1f}"),
    ("train/grad_norm", "grad norm", "{:.4f}"),
    ("train/skipped_steps", "skipped", "{:d}"),  # fp16 rows only (see format_row)
    ("throughput/tokens_per_sec", "tokens/s", "{:,.0f}"),
    ("timers/ms_per_iter", "ms/iter", "{:.1f}"),
    # the same number of decimals on every row, so the column does not jump between 0.0157 and 0.00909
    ("throughput/tflops_per_device", "TFLOP/s", "{:.3f}"),
    ("throughput/mfu", "MFU", "{:.1%}"),
    ("throughput/hfu", "HFU", "{:.1%}"),
]


def format_row(row: dict[str, Any], train_iters: int | None = None) -> str:
    """``iteration 10/100 | loss 9.1 | lr 1e-3 | ...`` for the metrics present in ``row``."""
    total = f"/{train_iters}" if train_iters else ""
    parts = [f"iteration {row.get('iteration', '?')}{total}"]
    for key, label, fmt in _FORMATS:
        value = row.get(key)
        if value is None:
            continue
        if key == "train/skipped_steps" and "train/loss_scale" not in row:
            continue  # only fp16's loss scaling skips steps: "skipped 0" says nothing elsewhere
        try:
            parts.append(f"{label} {fmt.format(value)}")
        except (ValueError, TypeError):
            parts.append(f"{label} {value}")
    return " | ".join(parts)


def set_deepspeed_log_level(level: str) -> None:
    """Level of DeepSpeed's logger in this process (the runner and launcher get ``--log_level``)."""
    # lazy: DeepSpeed's logger, only in processes that run DeepSpeed
    from deepspeed.utils.logging import set_log_level_from_string

    set_log_level_from_string(level)
