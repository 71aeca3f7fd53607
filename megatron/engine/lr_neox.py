"""GPT-NeoX's learning-rate curve, as a pure function of the step.

GPT-NeoX (``megatron/learning_rates.py`` ``AnnealingLR.get_lr``, lines 63-89 at ea7aefd8, built by
``megatron/training.py`` ``get_learning_rate_scheduler``, lines 1117-1137) computes, for the number
of optimizer steps taken ``n`` (0 for the first update), ``T`` = ``lr_decay_iters`` (else
``floor(train_iters * lr_decay_fraction)``, else ``train_iters``; at least 1) and ``W`` =
``warmup * T`` (a float):

* warmup, while ``W > 0`` and ``n <= W``: ``lr * max(1, n) / W`` (``max(1, n)`` since #1379, May 2026:
  the first update no longer uses 0; with ``W < 1`` that first update is *above* ``lr``, as there);
* then, with ``m = n - W`` and ``S = T - W``:

  - ``linear``: ``lr * (S - m) / S``
  - ``cosine``: ``min_lr + (lr - min_lr) / 2 * (cos(pi * m / S) + 1)`` (interpolated to ``min_lr``)
  - ``exponential``: ``lr * exp(-0.693 * m / S)`` (0.693, not ln 2)
  - ``constant``: ``lr``

  each floored at ``min_lr``. Past ``T`` the formulas go on: linear and exponential keep falling to
  the floor, the cosine rises again.

Deepy's own extras (cycles, ``decay_fraction``, ``rewarmup``) are not GPT-NeoX's; a schedule that uses
them goes through the general phases of ``megatron/engine/lr_schedules.py``.
"""

from __future__ import annotations

import math

NEOX_STYLES = ("constant", "linear", "cosine", "exponential")
"""GPT-NeoX's ``lr_decay_style`` values (``NeoXArgsLRScheduler``)."""

EXPONENTIAL_RATE = 0.693
"""GPT-NeoX's constant for ``exponential`` (learning_rates.py:84-86): halves the rate over the decay, to
three digits."""


def annealing_lr(style: str, max_lr: float, min_lr: float, warmup_steps: float, total_steps: int, step: int) -> float:
    """The rate GPT-NeoX's ``AnnealingLR`` uses for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * max(1, step) / warmup_steps
    decayed = step - warmup_steps
    span = total_steps - warmup_steps
    if span <= 0:  # warmup spans the whole schedule: GPT-NeoX divides by zero here; hold the peak
        return max(max_lr, min_lr)
    if style == "linear":
        lr = max_lr * (span - decayed) / span
    elif style == "cosine":
        lr = min_lr + (max_lr - min_lr) / 2.0 * (math.cos(math.pi * decayed / span) + 1)
    elif style == "exponential":
        lr = max_lr * math.exp(-EXPONENTIAL_RATE * decayed / span)
    else:
        lr = max_lr
    return max(lr, min_lr)


def decay_steps(train_iters: int, lr_decay_iters: int | None, lr_decay_fraction: float | None) -> int:
    """``T``: GPT-NeoX's ``get_learning_rate_scheduler`` (training.py:1117-1123 at ea7aefd8):
    ``lr_decay_iters`` wins over ``lr_decay_fraction``, which is floored; at least 1 step."""
    if lr_decay_iters is not None:
        steps = lr_decay_iters
    elif lr_decay_fraction is not None:
        steps = math.floor(train_iters * lr_decay_fraction)
    else:
        steps = train_iters
    return max(1, steps)
