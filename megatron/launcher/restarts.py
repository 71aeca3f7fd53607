"""``max_restarts``: a launch whose rank died or hung is started again, resuming from the last committed checkpoint.

One launch is :class:`~megatron.launcher.run.LaunchSupervisor`'s; this module decides what follows it. A launch
that failed (not a clean finish, not a requested stop) is launched again from a fresh plan (a free master port
where deepy picked the last one: the old one may still be held by the dead launch's sockets), on the same
hosts: the local per-node launcher, DeepSpeed's runner over pdsh, mpirun, or srun again inside the same
allocation. The ranks resume from the newest committed checkpoint in ``load`` exactly as a launch by hand does.
Each restart is said on the console and written to the run's ``metrics.jsonl`` as an event row
(``{"event": "restart", ...}``, no ``iteration``: a resumed run's truncation keeps it), and the relaunched ranks
learn of it through :data:`RESTARTS_ENV` (they log ``resilience/restarts`` to the trackers and the run summary).

Not restarted: a requested stop (SIGTERM/SIGINT/SIGHUP/SIGUSR1 to deepy, during or between launches), a rank
that refused its input (exit code 2: it would refuse again), and a failure once ``max_restarts`` are used; then
deepy exits with the launch's code and says how many restarts were used and where the last checkpoint is. A
failure at the step the previous one failed at counts like any other and is said as such ("no step was completed
since the last restart"): a fault that recurs at one step spends the budget rather than looping forever.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from megatron.errors import ConfigError
from megatron.launcher.plan import LaunchPlan
from megatron.logging import heartbeats, rank_errors
from megatron.logging.heartbeats import RESTARTS_ENV
from megatron.logging.metrics import append_event

USER_ERROR_EXIT_CODE = 2
_UNSET = object()


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    run_dir: str
    last_checkpoint: Callable[[], str | None]
    """Where the newest committed checkpoint is, in words (``checkpoints/global_step8``), or None: there is none."""


def check_restartable(plan: LaunchPlan, max_restarts: int, shown: str) -> None:
    """Refuse ``max_restarts`` where deepy does not start the ranks (each task of srun/mpirun runs deepy.py
    itself: no one is left to start them again). ``shown``: the key as the config set it (file:line)."""
    if max_restarts > 0 and plan.in_place:
        raise ConfigError(f"{shown}: this launch has srun/mpirun start deepy.py on every rank ({plan.mode}), so no "
                          f"process is left to launch the ranks again; run deepy.py once (in the batch step, "
                          f"launcher: slurm) to restart them, or set max_restarts: 0")


def first_failure(run_dir: str | os.PathLike[str]) -> tuple[int | None, str]:
    """The rank that failed first and how, from the launch's error records (:mod:`rank_errors`)."""
    errors, printed = rank_errors.read_errors(run_dir)
    exits = [e for e in rank_errors.read_exits(run_dir) if e.rank not in {x.rank for x in errors}]
    earliest = min((e.at for e in errors if e.at), default=None)
    if exits and (earliest is None or exits[0].alive_at < earliest):
        ended = exits[0]
        where = f" on host {ended.host}" if ended.host else ""
        return ended.rank, f"rank {ended.rank}{where} {ended.how}"
    chosen = next((e for e in errors if e.rank == printed), errors[0] if errors else None)
    if chosen is None:
        return None, "the launch failed without a record of which rank failed"
    text = chosen.message.removeprefix("deepy: ")
    stuck = re.match(r"hang: rank (\d+) ", text)  # the watch's record names the stuck rank, not its own
    if stuck:
        return int(stuck.group(1)), text
    return chosen.rank, text if text.startswith("hang:") or text.startswith("rank ") else f"rank {chosen.rank}: {text}"


class _StopNotes:
    """Stop requests that arrive between launches (during one, the supervisor's own handlers take them)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.previous: dict[signal.Signals, Any] = {}

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self.signals.append(signum)

    def __enter__(self) -> _StopNotes:
        # lazy: launcher.run imports psutil, only when a launch runs
        from megatron.launcher.run import STOP_SIGNALS

        self.previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_with_restarts(plan: LaunchPlan, replan: Callable[[], LaunchPlan], environ: Mapping[str, str],
                      policy: RestartPolicy, *, verbose: bool = False, memory: str | None = None,
                      trains: bool = True) -> int:  # fmt: skip
    """Run ``plan``; while it fails and restarts are left, run ``replan()``'s plan. Returns deepy's exit code."""
    # lazy: launcher.run imports psutil, only when a launch runs
    from megatron.launcher.run import LaunchSupervisor, launch_line, worker_environment

    done: list[dict[str, Any]] = []
    failed_at: object = _UNSET
    with _StopNotes() as stops:
        while True:
            print(launch_line(plan, verbose), flush=True)
            added = {**plan.env, **({RESTARTS_ENV: json.dumps(done)} if done else {})}
            supervisor = LaunchSupervisor(plan, worker_environment(environ, added), memory, trains)
            code = supervisor.run()
            if code == 0 or supervisor.stop_signal is not None or policy.max_restarts == 0:
                return code
            if plan.restarts_itself:  # torchrun's agents had max_restarts themselves (launcher: torchrun)
                print(f"deepy: the run failed after torchrun's restarts (--max-restarts={policy.max_restarts}); the "
                      f"last committed checkpoint is {policy.last_checkpoint() or 'none (nothing was saved)'}",
                      flush=True)  # fmt: skip
                return code
            rank, reason = first_failure(policy.run_dir)
            step = heartbeats.steps_done(policy.run_dir)
            checkpoint = policy.last_checkpoint()
            resume = f"checkpoint {checkpoint}" if checkpoint else "the start (no checkpoint was committed)"
            if stops.signals:
                print(f"deepy: {signal.Signals(stops.signals[0]).name} while the ranks were failing: not restarting",
                      flush=True)  # fmt: skip
                return code
            if code == USER_ERROR_EXIT_CODE:
                print(f"deepy: not restarting: a rank refused its input (exit code 2), and a restart would refuse "
                      f"it again", flush=True)  # fmt: skip
                return code
            stalled = failed_at is not _UNSET and step == failed_at
            failed_at = step
            at = f"after step {step}" if step is not None else "before any step was recorded"
            note = "; no step was completed since the last restart" if stalled else ""
            if len(done) >= policy.max_restarts:
                print(f"deepy: giving up after {len(done)} restart{'s' if len(done) != 1 else ''} (max_restarts="
                      f"{policy.max_restarts}): {reason} ({at}{note}); the last committed checkpoint is "
                      f"{checkpoint or 'none (nothing was saved)'}", flush=True)  # fmt: skip
                return code
            number = len(done) + 1
            print(f"deepy: restart {number} of {policy.max_restarts}: {reason} ({at}{note}); resuming from {resume}",
                  flush=True)  # fmt: skip
            event = {"rank": rank, "step": step, "reason": reason + note}
            append_event(policy.run_dir, {"event": "restart", **event, "restart": number,
                                          "max_restarts": policy.max_restarts, "time": time.time()})
            done.append(event)
            rank_errors.clear(policy.run_dir)
            heartbeats.clear(policy.run_dir)
            if stops.signals:
                return code
            plan = replan()
