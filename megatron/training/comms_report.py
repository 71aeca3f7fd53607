"""DeepSpeed's communication logger (``comms_logger``), shown.

``comms_logger: {enabled: true, prof_all: true, verbose: false, debug: false, prof_ops: [...]}`` goes to
DeepSpeed, whose engine then times every collective it issues through ``deepspeed.comm`` (the gradient
all-reduce, ZeRO's gathers and reduce-scatters, pipeline sends and receives). DeepSpeed keeps the numbers
and prints them only when asked (``deepspeed.comm.log_summary()``), which GPT-NeoX never does; here the
loop asks:

* after the last step, always (a table per operation and message size: count, total and average latency,
  algorithmic and bus bandwidth), on global rank 0;
* with ``verbose: true``, also at every ``log_interval`` step (the numbers so far). DeepSpeed's own
  per-operation lines of ``verbose`` go through its logger, shown with ``deepspeed_log_level: info``.

Collectives Deepy issues through ``torch.distributed`` itself (the loss all-reduce, the objective's
metrics) are not DeepSpeed's to time and do not appear. ``log_summary`` synchronises all ranks, so every
rank calls it at the same steps (the hooks run on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import deepspeed.comm


def _deepspeed_summary() -> None:
    deepspeed.comm.log_summary()


class CommsReport:
    """The loop's hooks that show the summary; inert when ``comms_logger`` is off."""

    def __init__(self, block: dict[str, Any] | None, log_interval: int,
                 show: Callable[[], None] = _deepspeed_summary) -> None:
        block = block or {}
        self.enabled = bool(block.get("enabled"))
        self.every = int(log_interval) if self.enabled and block.get("verbose") and log_interval else 0
        self.show = show

    def after_step(self, eng: Any, state: Any) -> bool:
        if self.every and state.iteration % self.every == 0:
            self.show()
        return False  # never asks the loop to stop

    def at_exit(self, eng: Any, state: Any) -> None:
        if self.enabled:
            self.show()
