"""Preemption: SIGTERM/SIGUSR1 -> finish the step, save, exit 0; and the once-per-step agreement
that carries it.

The signal handler only sets a flag; the training loop asks :meth:`PreemptionWatcher.agree` once per
step, which all-reduces the flag (MAX) so every rank stops after the *same* step even though a
scheduler may signal ranks at different moments - otherwise one rank would enter the checkpoint
barrier while the others wait in the next step's all-reduce. The same all-reduce carries rank 0's
word on clock-based saves (``save_interval``: the step at which its clock found the interval
elapsed), so they cost no collective of their own.

Under NCCL the values live on the GPU, and reading them right after the all-reduce would make the
host wait for the whole step queued before it, every step. There the answer is read one step late:
each call queues this step's all-reduce and an asynchronous copy into pinned memory, and returns the
previous call's agreed values, whose copy finished while this step ran. Every rank reads the same
step's answer, so all still stop (or save) after the same step (one step after the signal, or after
rank 0's clock said so). With gloo the values are host memory and the answer is read at once.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from megatron.checkpointing.stop_request import STOP_SIGNALS
from megatron.mpu.topology import collective_device

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = STOP_SIGNALS


class PreemptionWatcher:
    """Turns preemption signals into a flag that all ranks agree on."""

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.signal_name: str | None = None
        self._agreed = AgreedFlag()

    def install(self) -> PreemptionWatcher:
        for sig in self.signals:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # nothing but a flag: the handler runs between two bytecodes of the training step
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agree(self, time_save_step: int = 0, group: dist.ProcessGroup | None = None) -> Agreement:
        """This step's agreement (collective: every rank calls it once per step). ``time_save_step``:
        the step at which this rank's clock finds a time-based save due, 0 if none (only rank 0's
        counts: the others post 0)."""
        flag, time_save_step = self._agreed.exchange((1 if self.requested else 0, time_save_step), group)
        stop = bool(flag)
        if stop and not self.requested:
            self.requested = True
            self.signal_name = self.signal_name or "a signal on another rank"
        return Agreement(stop=stop, time_save_step=time_save_step)

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank as soon as any rank received a signal (collective: all must call)."""
        return self.agree(0, group).stop


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on after a step (one step late under NCCL)."""

    stop: bool
    """Some rank was signalled: save and stop."""
    time_save_step: int
    """The step at which rank 0's clock found a time-based save due (0: none)."""


class AgreedFlag:
    """The elementwise MAX over ranks of a few small integers each rank posts once per step.

    ``deferred`` (None: when the collective runs on a GPU) returns, from each call, the values agreed
    by the *previous* call (zeros for the first), read from pinned memory once the copy queued behind
    the all-reduce is done, so the host never waits for the step in flight; otherwise the values just
    agreed."""

    def __init__(self, deferred: bool | None = None) -> None:
        self.deferred = deferred
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def exchange(self, values: Sequence[int], group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
        device = collective_device(group)
        flags = torch.tensor(list(values), dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        deferred = device.type != "cpu" if self.deferred is None else self.deferred
        if not deferred:
            return tuple(int(v) for v in flags.tolist())
        on_gpu = device.type == "cuda"
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=on_gpu)
        host.copy_(flags, non_blocking=on_gpu)
        done = torch.cuda.Event() if on_gpu else None
        if done is not None:
            done.record()
        previous, self._pending = self._pending, (host, done)
        if previous is None:
            return (0,) * len(values)
        agreed, copied = previous
        if copied is not None:
            copied.synchronize()  # recorded a step ago: already complete while this step runs
        return tuple(int(v) for v in agreed.tolist())
