"""Preemption: SIGTERM/SIGUSR1 -> finish the step, save, exit 0.

The signal handler only sets a flag; the training loop asks :meth:`PreemptionWatcher.should_stop`
once per step, which all-reduces the flag (MAX) so every rank stops after the *same* step even
though a scheduler may signal ranks at different moments - otherwise one rank would enter the
checkpoint barrier while the others wait in the next step's all-reduce.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

from megatron.mpu.topology import collective_device

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Turns preemption signals into a flag that all ranks agree on."""

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.signal_name: str | None = None

    def install(self) -> PreemptionWatcher:
        for sig in self.signals:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # nothing but a flag: the handler runs between two bytecodes of the training step
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank as soon as any rank received a signal (collective: all must call)."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=collective_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stop = bool(flag.item())
        if stop and not self.requested:
            self.requested = True
            self.signal_name = self.signal_name or "a signal on another rank"
        return stop
