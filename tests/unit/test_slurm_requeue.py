"""A Slurm job stopped by its time limit or a preemption requeues itself (megatron/launcher/requeue.py): how Slurm's
record of the job is read, which stops are requeued, how the budget counts, and the keys' checks and dry-run line.
The real requeues (a one-minute job on the test cluster) are in tests/e2e/test_slurm.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron.launcher.requeue import SlurmJob, requeues_without_progress, stop_reason

REPO = Path(__file__).resolve().parents[2]
# scontrol show job -o of a running sbatch job on slurm-wlm 22.05.8 (the test cluster), cut to the fields around the
# ones read; a cluster with preemption on adds PreemptEligibleTime=... PreemptTime=None
RUNNING = ("JobId=1 JobName=j.sh UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
           "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:31 TimeLimit=00:01:00 TimeMin=N/A "
           "SubmitTime=2026-11-28T21:43:57 StartTime=2026-11-28T21:43:57 EndTime=2026-11-28T21:44:57 "
           "Deadline=N/A SuspendTime=None")
END = time.mktime((2026, 11, 28, 21, 44, 57, 0, 0, -1))


def test_the_job_record_is_read_as_slurm_prints_it() -> None:
    job = SlurmJob.parse("1", RUNNING)
    assert (job.state, job.batch, job.restarts, job.end_time, job.preempt_time) == ("RUNNING", True, 0, END, None)
    preempted = SlurmJob.parse("1", RUNNING.replace("Restarts=0", "Restarts=2") +
                               " PreemptEligibleTime=2026-11-28T21:43:57 PreemptTime=2026-11-28T21:44:30")
    assert (preempted.restarts, preempted.preempt_time) == (2, "2026-11-28T21:44:30")
    assert SlurmJob.parse("1", RUNNING + " PreemptTime=None").preempt_time is None
    assert SlurmJob.parse("1", RUNNING.replace("EndTime=2026-11-28T21:44:57", "EndTime=Unknown")).end_time is None


def test_only_a_time_limit_or_a_preemption_is_requeued() -> None:
    job = SlurmJob.parse("1", RUNNING)
    assert stop_reason(job, END - 31) == ("time limit", "31 s left of its time limit")
    # scancel --signal=TERM an hour before the end: a person asked it to stop
    reason, why = stop_reason(job, END - 3600)
    assert reason is None and "stopped on a request" in why and "60 min left" in why
    unlimited = SlurmJob.parse("1", RUNNING.replace("EndTime=2026-11-28T21:44:57", "EndTime=Unknown"))
    assert stop_reason(unlimited, END)[0] is None
    preempted = SlurmJob.parse("1", RUNNING + " PreemptTime=2026-11-28T21:44:30")
    assert stop_reason(preempted, END - 3600)[0] == "preempted"
    # scancel (the job is cancelled, Slurm ends it) and salloc (not a batch job) are never requeued
    assert stop_reason(SlurmJob.parse("1", RUNNING.replace("RUNNING", "CANCELLED")), END - 31)[0] is None
    assert stop_reason(SlurmJob.parse("1", RUNNING.replace("BatchFlag=1", "BatchFlag=0")), END - 31)[0] is None


def test_the_budget_counts_this_jobs_requeues_in_a_row_at_the_same_step() -> None:
    rows = [{"job": "7", "step": 0}, {"job": "7", "step": 12}, {"job": "9", "step": 12}, {"job": "7", "step": 12},
            {"job": "7", "step": 12}]
    assert requeues_without_progress(rows, "7", 12) == 3  # job 9 (another submission) does not count
    assert requeues_without_progress(rows, "7", 20) == 0  # progress since the last requeue
    assert requeues_without_progress(rows, "9", 12) == 1
    assert requeues_without_progress([], "7", 0) == 0


CONFIG = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
train_batch_size: 8
train_iters: 10
optimizer: {type: Adam, params: {lr: 0.001}}
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
launcher: slurm
deepspeed_slurm: true
num_gpus: 2
"""


def dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    config = tmp_path / "run.yml"
    config.write_text(CONFIG)
    argv = ["--dry-run", str(REPO / "train.py"), str(config), *overrides]
    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out + captured.err


def test_the_dry_run_says_what_a_stopped_job_does_and_bad_values_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a login node: the srun command is not checked
    code, out = dry_run(tmp_path, capsys, "max_requeues_without_progress=2")
    assert code == 0, out
    assert ("Slurm requeue: on: a batch job stopped by its time limit or a preemption saves, then requeues itself "
            "(scontrol requeue); it stops after 2 requeue(s) in a row without a new checkpoint") in out
    code, out = dry_run(tmp_path, capsys, "slurm_requeue=false")
    assert code == 0 and "Slurm requeue: off (slurm_requeue: false)" in out, out
    code, out = dry_run(tmp_path, capsys, "max_requeues_without_progress=0")
    assert code == 2 and "max_requeues_without_progress" in out and "Traceback" not in out, out


def test_the_requeue_keys_are_refused_for_another_launcher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = dry_run(tmp_path, capsys, "launcher=pdsh", "deepspeed_slurm=false", "max_requeues_without_progress=5")
    assert code == 2 and "max_requeues_without_progress=5 (command line) only apply to a Slurm batch job" in out, out
