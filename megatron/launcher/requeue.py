"""Slurm time limits and preemption without a person: a batch job whose ranks stopped to save requeues itself.

deepy.py calls :func:`requeue_after_stop` once, after the launch ended with every rank stopped cleanly short of
``train_iters`` (they saved on a stop request: Slurm's time-limit signal, ``--signal=USR1@120`` in
``tools/slurm/train.sbatch``, or preemption's SIGTERM). Slurm's own record of the job says why
(``scontrol show job``):

* ``PreemptTime`` set: the job was preempted (``PreemptMode=CANCEL`` or ``REQUEUE`` with a ``GraceTime``: Slurm
  sends SIGCONT and SIGTERM to the job's steps, src/interfaces/preempt.c:_job_check_grace_internal@284c3b9; on
  the test cluster's 22.05 the ranks get it, the batch step does not; where deepy gets it too it passes it on as
  any stop request). With ``REQUEUE`` Slurm would requeue the job at the end of the grace time; deepy's comes first;
* ``EndTime`` less than :data:`TIME_LIMIT_WINDOW_S` away: its time limit (Slurm sends the ``--signal`` warning
  up to ``PERIODIC_TIMEOUT`` = 30 s before its lead, src/slurmctld/job_mgr.c:send_job_warn_signal@284c3b9, and
  ends the job at its first check after the limit plus ``OverTimeLimit``, 0 by default);
* otherwise a person asked it to stop (``scancel --signal=TERM``): not requeued, as before. A job no longer
  ``RUNNING`` (``scancel``led) is not requeued either.

Why ``scontrol requeue`` and not a new ``sbatch``: the requeued job keeps its id, its script and every option it
was submitted with (``sbatch --nodes=4 --time=...`` on the command line included, which the job cannot read
back to resubmit itself), its place in the accounting, and Slurm counts its restarts (``SLURM_RESTART_COUNT``);
PyTorch Lightning's auto-requeue does the same (src/lightning/pytorch/trainer/connectors/signal_connector.py:90
@7f0c343). It needs a requeueable job (``#SBATCH --requeue``, or ``JobRequeue=1``, slurm.conf's default; refused
otherwise: src/slurmctld/job_mgr.c:17270@slurm-22-05-8-1) and a batch job (not ``salloc``). Slurm makes a
requeued job wait ``cred_expire`` + 1 s (AuthInfo, 120 s by default) before it may start again
(src/slurmctld/job_mgr.c:16104@slurm-22-05-8-1), and the job's output file starts afresh unless it is opened
with ``--open-mode=append`` (the shipped script does).

The retry budget lives in the ``save`` directory (:data:`LEDGER_FILE`, one JSON row per requeue), not in the run
directory: a run's directory is named after its checkpoint, so a job that never reaches a checkpoint would get
a fresh directory, and a zero count, on every requeue, which is the very job the budget must stop; ``save`` is
where progress is measured (the newest committed step) and is locked by the running job. Only this job's rows
count (a person's resubmission, a new job id, starts afresh). A job requeued ``max_requeues_without_progress``
times in a row without a new checkpoint step is not requeued again: deepy says so and exits with
:data:`BUDGET_SPENT_EXIT_CODE`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEDGER_FILE = "slurm_requeues.jsonl"
TIME_LIMIT_WINDOW_S = 20 * 60
"""A clean stop with less than this left of the job's time limit is the limit's signal (or as good as)."""
BUDGET_SPENT_EXIT_CODE = 75
"""deepy's exit code when the job stopped and its requeue budget is spent (EX_TEMPFAIL: try again later)."""


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job`` says of a job (the fields the decision reads)."""

    job_id: str
    state: str
    batch: bool
    restarts: int
    end_time: float | None
    """The job's projected end (its time limit), seconds since the epoch; None without a limit."""
    preempt_time: str | None
    """When the job was preempted; None when it was not (or preemption is off)."""

    @classmethod
    def parse(cls, job_id: str, text: str) -> SlurmJob:
        fields: dict[str, str] = {}
        for token in text.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        preempted = fields.get("PreemptTime")
        return cls(job_id=job_id, state=fields.get("JobState", ""), batch=fields.get("BatchFlag") == "1",
                   restarts=int(fields.get("Restarts", "0") or 0), end_time=_slurm_time(fields.get("EndTime")),
                   preempt_time=preempted if preempted and preempted not in ("None", "Unknown") else None)


def _slurm_time(text: str | None) -> float | None:
    """``2026-11-28T21:44:57`` (Slurm prints local time) -> seconds since the epoch; None for Unknown/None."""
    if not text or not text[:1].isdigit():
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def show_job(job_id: str, env: Mapping[str, str]) -> SlurmJob:
    """The job as Slurm sees it (:class:`RequeueFailed` when it cannot be read)."""
    return SlurmJob.parse(job_id, _run(["scontrol", "show", "job", "-o", job_id], env))


def _run(argv: list[str], env: Mapping[str, str]) -> str:
    """stdout of ``argv``; raises :class:`RequeueFailed` with Slurm's message."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(env),
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise RequeueFailed(f"'{' '.join(argv)}' failed: {err}") from None
    if done.returncode != 0:
        raise RequeueFailed(f"'{' '.join(argv)}' failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


class RequeueFailed(Exception):
    """A Slurm command the requeue needs failed (its message says why)."""


def stop_reason(job: SlurmJob, now: float) -> tuple[str | None, str]:
    """Why the job's ranks were stopped, as a requeue reason (``"preempted"``, ``"time limit"``), or None and
    why the stop is not requeued."""
    if job.state != "RUNNING":
        return None, f"the job is {job.state or 'not running'} (cancelled?)"
    if not job.batch:
        return None, "not a batch job (salloc): only sbatch jobs can be requeued"
    if job.preempt_time is not None:
        return "preempted", f"at {job.preempt_time}"
    if job.end_time is not None and job.end_time - now <= TIME_LIMIT_WINDOW_S:
        return "time limit", f"{max(0, round(job.end_time - now))} s left of its time limit"
    left = "no time limit" if job.end_time is None else f"{round((job.end_time - now) / 60)} min left of its time limit"
    return None, f"stopped on a request, not by the time limit or a preemption ({left})"


@dataclass(frozen=True)
class Requeue:
    """One requeue, as the ledger and metrics.jsonl record it."""

    job: str
    restart: int
    """Slurm's restart count of the run that stopped (0: the first run of the job)."""
    step: int
    """The newest committed checkpoint step when it stopped."""
    reason: str
    time: float

    def row(self) -> dict[str, Any]:
        return {"event": "requeue", "step": self.step, "reason": self.reason, "job": self.job,
                "restart": self.restart, "time": self.time}


def read_ledger(save: Path) -> list[dict[str, Any]]:
    path = save / LEDGER_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line of a job killed while appending
        if isinstance(row, dict):
            rows.append(row)
    return rows


def requeues_without_progress(rows: list[dict[str, Any]], job: str, step: int) -> int:
    """How many of this job's last requeues in a row were made at ``step`` (none of them saved a newer step)."""
    count = 0
    for row in reversed([r for r in rows if str(r.get("job")) == job]):
        if row.get("step") != step:
            break
        count += 1
    return count


def requeue_after_stop(*, environ: Mapping[str, str], save: Path, step: int, max_without_progress: int,
                       metrics: Path | None, say: Callable[[str], None],
                       clock: Callable[[], float] = time.time) -> int:  # fmt: skip
    """Requeue this Slurm batch job, whose ranks stopped cleanly at checkpoint ``step`` short of the end, when Slurm
    stopped it (time limit, preemption) and its budget allows; returns deepy's exit code. ``metrics``: the run's
    metrics.jsonl, which gets the requeue's event row."""
    job_id = environ.get("SLURM_JOB_ID", "")
    try:
        job = show_job(job_id, environ)
        reason, why = stop_reason(job, clock())
        if reason is None:
            say(f"not requeued: {why}; submit the job again to resume from step {step}")
            return 0
        ledger = read_ledger(save)
        stalled = requeues_without_progress(ledger, job_id, step)
        if stalled >= max_without_progress:
            say(f"{reason} ({why}): not requeued again: job {job_id} was requeued {stalled} time(s) in a row without "
                f"a new checkpoint (still at step {step} of {save}; max_requeues_without_progress="
                f"{max_without_progress}); the record is {save / LEDGER_FILE}")
            return BUDGET_SPENT_EXIT_CODE
        event = Requeue(job=job_id, restart=job.restarts, step=step, reason=reason, time=clock())
        _append(save / LEDGER_FILE, event.row())  # first: a requeue counts even where Slurm ends this job at once
        say(f"{reason} ({why}): saved at step {step}; requeueing job {job_id} (requeue {job.restarts + 1}; "
            f"{stalled} in a row without progress, at most {max_without_progress}): scontrol requeue {job_id}")
        # Slurm ends this job's processes (SIGTERM) once it is requeued: what is left to do must not be cut short
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            _run(["scontrol", "requeue", job_id], environ)
        except RequeueFailed:
            signal.signal(signal.SIGTERM, previous)
            raise
        if metrics is not None:
            _append(metrics, event.row())
        return 0
    except RequeueFailed as failed:
        say(f"could not requeue job {job_id}: {failed}; the run saved step {step}: submit the job again to resume "
            f"(a job needs #SBATCH --requeue, or JobRequeue=1 in slurm.conf, to requeue itself)")
        return 0


def describe(enabled: bool, max_without_progress: int) -> str:
    """The dry run's line on what a stopped Slurm job does."""
    if not enabled:
        return "Slurm requeue: off (slurm_requeue: false): a job stopped by its time limit or a preemption ends"
    return (f"Slurm requeue: on: a batch job stopped by its time limit or a preemption saves, then requeues itself "
            f"(scontrol requeue); it stops after {max_without_progress} requeue(s) in a row without a new checkpoint "
            f"(max_requeues_without_progress)")


def _append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")
        out.flush()
        os.fsync(out.fileno())
