"""Deepy on a real Slurm cluster (two slurmd nodes on this machine, see slurm_cluster.py).

Jobs are submitted with the shipped ``tools/slurm/train.sbatch``: deepy.py runs in the batch
script and ``srun`` starts one rank per task, one on each node.

* A 2-node training job stopped with ``scancel --signal=TERM`` saves a checkpoint, the job
  completes with exit code 0, nothing is left running, and the resubmitted job resumes on the
  uninterrupted loss curve (within 1e-6).
* ``scancel --batch --signal=TERM`` signals deepy.py itself, which passes the stop on to every rank.
  The ranks find their node, rank and rendezvous (the first node's address) from Slurm; the user's
  environment (secrets included) reaches them without appearing on any command line.
* A rank that fails makes srun, deepy and the job fail.
* ``scancel --full --signal=TERM`` (batch step and ranks at once) stops as cleanly.
* A job given a one-minute time limit saves on Slurm's warning signal, requeues itself and finishes on the
  uninterrupted curve; a job that never makes progress stops after its requeue budget (both at once: minutes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import (
    FAIL_WORKER,
    TRAIN,
    REPO,
    SAVE,
    STOP_WORKER,
    TRAIN_ITERS,
    assert_curves_match,
    command_lines_containing,
    deepy_env,
    latest_step,
    losses,
    ready_files,
    stopped_signals,
    survivors,
    write_model,
    write_script,
)
from slurm_cluster import NODES, SlurmCluster, missing_reason

pytestmark = pytest.mark.slow

SBATCH = str(REPO / "tools" / "slurm" / "train.sbatch")
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]
SECRET = "slurm-test-secret-4242"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit(slurm: SlurmCluster, tmp: Path, *args: str, script: str | None = None,
           env: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> int:  # fmt: skip
    job_env = deepy_env({**slurm.env, "PYTHON": __import__("sys").executable, "DEEPY_HOME": str(REPO), **(env or {})})
    if script:
        job_env["DEEPY_SCRIPT"] = script
    return slurm.sbatch([*TWO_NODES, *options, f"--output={tmp}/job-%j.out", SBATCH, *args], cwd=tmp, env=job_env)


def job_output(tmp: Path, job: int) -> str:
    path = tmp / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_output(tmp: Path, job: int, text: str, slurm: SlurmCluster, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in job_output(tmp, job):
            return
        if slurm.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job} never printed {text!r}:\n{job_output(tmp, job)[-4000:]}")


def test_scancel_stops_a_two_node_job_which_resumes_on_the_same_curve(
    slurm: SlurmCluster, tmp_path: Path, reference_curve: dict[int, float]
) -> None:
    write_model(tmp_path)
    job = submit(slurm, tmp_path, "model.yml", "log_dir=logs1", *SAVE)
    wait_output(tmp_path, job, f"iteration 3/{TRAIN_ITERS}", slurm)
    assert slurm.run(["scancel", "--signal=TERM", str(job)]).returncode == 0
    info = slurm.wait_job(job)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert info["NodeList"] == "deepy-n[1-2]"
    assert "via srun" in out and "--nodes=2 --ntasks=2 --ntasks-per-node=1" in out
    assert "preempted (SIGTERM); checkpoint saved" in out
    # a person's stop (the job has no time limit here, and was not preempted) is not requeued
    assert "deepy: not requeued: stopped on a request" in out and info["Restarts"] == "0"
    assert survivors(tmp_path, wait_s=10) == []
    step = latest_step(tmp_path / "ckpt")
    assert 3 <= step < TRAIN_ITERS and max(losses(tmp_path / "logs1")) == step

    again = submit(slurm, tmp_path, "model.yml", "log_dir=logs2", *SAVE)
    info = slurm.wait_job(again)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job_output(tmp_path, again)[-4000:]
    curve = losses(tmp_path / "logs2")
    assert sorted(curve) == list(range(step + 1, TRAIN_ITERS + 1))
    assert_curves_match(losses(tmp_path / "logs1"), reference_curve, 1e-6)
    assert_curves_match(curve, reference_curve, 1e-6)


def test_launcher_torchrun_runs_an_agent_per_node_which_restarts_a_killed_rank(
    slurm: SlurmCluster, tmp_path: Path, reference_curve: dict[int, float]
) -> None:
    """issue 45: ``launcher: torchrun`` in the batch step: srun starts one torchrun agent per node (c10d rendezvous
    at the first node), ``max_restarts: 1`` is the agents' ``--max-restarts``; a ``kill -9`` of rank 1 at step 13
    is restarted by them (not by deepy) and the job finishes on the uninterrupted curve."""
    write_model(tmp_path)
    faults = {"DEEPY_FAULTS": "kill:1:13", "DEEPY_FAULT_MARKERS": str(tmp_path)}
    job = submit(slurm, tmp_path, "model.yml", "launcher=torchrun", "max_restarts=1", "log_dir=logs", "save=ckpt",
                 "load=ckpt", "checkpoint_factor=10", script=str(REPO / "tests" / "e2e" / "fault_train.py"), env=faults)
    info = slurm.wait_job(job)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-6000:]
    assert "via srun + torchrun" in out and "--nodes=2 --ntasks=2 --ntasks-per-node=1" in out
    assert f"--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:" in out
    assert f"--rdzv-id=slurm-{job} --max-restarts=1" in out
    assert (tmp_path / "fault0-kill-1-13").is_file() and "deepy: restart" not in out
    assert "resumed from ckpt/global_step10 (iteration 10" in out
    assert_curves_match(losses(tmp_path / "logs"), reference_curve, 1e-6)
    assert survivors(tmp_path, wait_s=10) == []


def test_a_signal_to_deepy_in_the_batch_step_reaches_every_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    env = {"WANDB_API_KEY": SECRET, "PYTHONPATH": f"{REPO}:/opt/user-lib"}
    job = submit(slurm, tmp_path, str(write_model(tmp_path)), "log_dir=logs", "comment=deepy-test",
                 script=str(worker), env=env)  # fmt: skip
    places = ready_files(tmp_path, 2)
    # one rank per node, ranks and node ids from Slurm, rendezvous at the first node's address
    assert [(p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for p in places] == [("0", "0", "2"), ("1", "0", "2")]
    assert [(p["host"], p["node"]) for p in places] == [(NODES[0], "0"), (NODES[1], "1")]
    assert {p["MASTER_ADDR"] for p in places} == {"127.0.0.1"}
    assert len({p["MASTER_PORT"] for p in places}) == 1 and places[0]["MASTER_PORT"] != "29500"  # picked free
    # the environment arrives whole: secrets by environment only, PYTHONPATH added to
    assert {p["secret_seen"] for p in places} == {SECRET} and command_lines_containing(SECRET) == []
    assert all("/opt/user-lib" in str(p["pythonpath"]).split(":") for p in places)

    assert slurm.run(["scancel", "--batch", "--signal=TERM", str(job)]).returncode == 0
    info = slurm.wait_job(job)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "deepy: stopped on SIGTERM: every rank stopped cleanly" in out
    assert stopped_signals(tmp_path) == ["SIGUSR1", "SIGUSR1"]
    assert "--comment=deepy-test" in out and SECRET not in out
    assert survivors(tmp_path, wait_s=10) == []


def test_a_failing_rank_fails_the_job_and_deepy(slurm: SlurmCluster, tmp_path: Path) -> None:
    worker = write_script(tmp_path, "fail_worker.py", FAIL_WORKER)
    started = time.monotonic()
    job = submit(slurm, tmp_path, str(write_model(tmp_path)), "log_dir=logs", "max_restarts=1", script=str(worker))
    info = slurm.wait_job(job, timeout=300)
    out = job_output(tmp_path, job)
    assert info["JobState"] == "FAILED", out
    # issue 43: max_restarts runs srun again inside the same allocation (one job); it fails again, deepy gives up
    assert out.count("deepy: starting 2 ranks via srun") == 2 and "deepy: restart 1 of 1: " in out, out
    assert "deepy: giving up after 1 restart (max_restarts=1)" in out
    assert "task 1: Exited with exit code 3" in out  # srun names the failed rank's code
    # srun's own code is its tasks' highest: rank 0, which it stopped with SIGTERM, counts as 143
    assert "deepy: run failed with exit code 143" in out and info["ExitCode"] == "143:0"
    assert time.monotonic() - started < 150  # rank 0 was stopped (twice), not left to sleep for 120 s
    assert survivors(tmp_path, wait_s=10) == []



def test_scancel_full_stops_cleanly_too(slurm: SlurmCluster, tmp_path: Path) -> None:
    """--full signals the batch step as well: deepy and the ranks both get SIGTERM. srun would turn a
    SIGTERM of its own into killing every task; deepy runs it in a session of its own, which this
    cluster's process tracking (proctrack/linuxproc) leaves out of the batch step's signal."""
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    job = submit(slurm, tmp_path, str(write_model(tmp_path)), "log_dir=logs", script=str(worker))
    ready_files(tmp_path, 2)
    assert slurm.run(["scancel", "--full", "--signal=TERM", str(job)]).returncode == 0
    info = slurm.wait_job(job)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "srun: forcing job termination" not in out
    assert len(stopped_signals(tmp_path)) == 2 and "timeout" not in stopped_signals(tmp_path)
    assert survivors(tmp_path, wait_s=10) == []


# train.py, 2 s slower a step in the job's first run (SLURM_RESTART_COUNT unset): a one-minute job is still
# training when its time limit's signal comes; after the requeue it runs at full speed. The steps themselves (and
# so the losses) are train.py's own.
SLOW_FIRST_RUN = f"""\
import os, runpy, sys, time
from megatron.checkpointing.stop_request import catch_until_training
from megatron.logging.rank_errors import current_rank

catch_until_training(current_rank())  # as train.py does first: a stop request while starting ends the rank cleanly
if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    import megatron.training.loop as loop
    step = loop.train_step
    def slow_step(*args, **kwargs):
        time.sleep(2)
        return step(*args, **kwargs)
    loop.train_step = slow_step
sys.argv[0] = {TRAIN!r}
runpy.run_path({TRAIN!r}, run_name="__main__")
"""
# Slurm's warning signal comes at its first time-limit check (every 30 s, PERIODIC_TIMEOUT) at most 15 + 30 s before
# the end, so 15 to 45 s into a one-minute job; the limit itself is enforced at the first check after 60 s
ONE_MINUTE = ("--time=1", "--signal=USR1@15")


@pytest.fixture(scope="module")
def requeued_jobs(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Two one-minute jobs submitted at once (each takes one core of each node): ``train`` trains (slowly at
    first) with the shipped script's requeueing; ``stuck`` never saves a step (a stand-in worker that only waits
    for a stop request), with max_requeues_without_progress=1."""
    train_dir, stuck_dir = tmp_path_factory.mktemp("requeue_train"), tmp_path_factory.mktemp("requeue_stuck")
    slow = write_script(train_dir, "slow_first_run.py", SLOW_FIRST_RUN)
    train = submit(slurm, train_dir, str(write_model(train_dir)), "log_dir=logs", *SAVE, script=str(slow),
                   options=ONE_MINUTE)  # fmt: skip
    worker = write_script(stuck_dir, "stop_worker.py", STOP_WORKER)
    stuck = submit(slurm, stuck_dir, str(write_model(stuck_dir)), "log_dir=logs", *SAVE,
                   "max_requeues_without_progress=1", script=str(worker), options=ONE_MINUTE)  # fmt: skip
    return {"train": (train_dir, train), "stuck": (stuck_dir, stuck)}


def test_a_job_at_its_time_limit_requeues_itself_and_finishes_on_the_same_curve(
    slurm: SlurmCluster, requeued_jobs: dict[str, tuple[Path, int]], reference_curve: dict[int, float]
) -> None:
    tmp, job = requeued_jobs["train"]
    info = slurm.wait_job(job, timeout=600)
    out = job_output(tmp, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-6000:]
    assert info["Restarts"] != "0", out[-6000:]
    assert "deepy: time limit (" in out and f"requeueing job {job}" in out, out[-6000:]
    assert latest_step(tmp / "ckpt") == TRAIN_ITERS
    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events = [row for row in rows if row.get("event") == "requeue"]
    assert events and all(e["reason"] == "time limit" and e["job"] == str(job) and "iteration" not in e
                          for e in events), events  # fmt: skip
    assert all(0 <= e["step"] < TRAIN_ITERS for e in events), events
    ledger = [json.loads(line) for line in (tmp / "ckpt" / "slurm_requeues.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == [e["step"] for e in events]
    curve = losses(tmp / "logs")
    assert sorted(curve) == list(range(1, TRAIN_ITERS + 1))  # the steps after the saved one are trained again
    assert_curves_match(curve, reference_curve, 1e-6)
    assert survivors(tmp, wait_s=10) == []


def test_a_job_that_never_progresses_stops_after_its_requeue_budget(
    slurm: SlurmCluster, requeued_jobs: dict[str, tuple[Path, int]]
) -> None:
    tmp, job = requeued_jobs["stuck"]
    info = slurm.wait_job(job, timeout=600)
    out = job_output(tmp, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "75:0", "1"), out[-6000:]
    assert f"requeueing job {job}" in out  # the first run's output is kept (--open-mode=append)
    assert (f"not requeued again: job {job} was requeued 1 time(s) in a row without a new checkpoint (still at "
            f"step 0") in out and "max_requeues_without_progress=1" in out, out[-6000:]
    ledger = [json.loads(line) for line in (tmp / "ckpt" / "slurm_requeues.jsonl").read_text().splitlines()]
    assert [(e["step"], e["reason"], e["restart"]) for e in ledger] == [(0, "time limit", 0)]
    assert survivors(tmp, wait_s=10) == []


def test_a_preempted_job_saves_requeues_itself_and_finishes_on_the_same_curve(
    slurm: SlurmCluster, tmp_path: Path, reference_curve: dict[int, float]
) -> None:
    """Partition ``low`` is preempted by ``urgent`` with PreemptMode=CANCEL and a GraceTime (slurm_cluster.py): Slurm
    sends SIGTERM to the job's steps (the ranks), which save; deepy finds ``PreemptTime`` set and requeues the job
    (Slurm itself would have cancelled it); it runs again once the urgent job is done."""
    slow = write_script(tmp_path, "slow_first_run.py", SLOW_FIRST_RUN)
    job = submit(slurm, tmp_path, str(write_model(tmp_path)), "log_dir=logs", *SAVE, script=str(slow),
                 options=("--partition=low",))  # fmt: skip
    wait_output(tmp_path, job, f"iteration 3/{TRAIN_ITERS}", slurm)
    # two tasks on each node: only room once the low job's are gone
    urgent = slurm.sbatch(["--partition=urgent", "--nodes=2", "--ntasks-per-node=2", f"--output={tmp_path}/urgent.out",
                           "--wrap=echo urgent ran"], cwd=tmp_path, env=deepy_env(slurm.env))  # fmt: skip
    info = slurm.wait_job(job)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-6000:]
    assert slurm.wait_job(urgent)["JobState"] == "COMPLETED"
    assert "preempted (SIGTERM); checkpoint saved" in out and "deepy: preempted (at " in out, out[-6000:]
    assert "deepy: SIGTERM" not in out  # Slurm 22.05 signals the steps (the ranks), not the batch step (deepy)
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    events = [row for row in rows if row.get("event") == "requeue"]
    assert [(e["reason"], e["job"]) for e in events] == [("preempted", str(job))] and 3 <= events[0]["step"] < 30
    curve = losses(tmp_path / "logs")
    assert sorted(curve) == list(range(1, TRAIN_ITERS + 1))
    assert_curves_match(curve, reference_curve, 1e-6)
    assert survivors(tmp_path, wait_s=10) == []


def test_a_job_slurm_may_not_requeue_says_so_and_ends_cleanly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A job submitted with --no-requeue (or on a cluster with JobRequeue=0 and no #SBATCH --requeue): Slurm refuses
    ``scontrol requeue``. deepy's requeue step, run here in the test's own process for a real running job with a
    one-minute limit (so: at its time limit), says why and that the job must be submitted again, and exits 0 (the
    ranks saved; nothing is lost)."""
    from megatron.launcher.requeue import requeue_after_stop

    job = slurm.sbatch(["--no-requeue", "--time=1", "--nodes=1", f"--output={tmp_path}/sleep.out", "--wrap=sleep 120"],
                       cwd=tmp_path, env=deepy_env(slurm.env))  # fmt: skip
    deadline = time.monotonic() + 120
    while slurm.job(job).get("JobState") != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    said: list[str] = []
    try:
        code = requeue_after_stop(environ={**deepy_env(slurm.env), "SLURM_JOB_ID": str(job)}, save=tmp_path / "ckpt",
                                  step=7, max_without_progress=3, metrics=tmp_path / "metrics.jsonl", say=said.append)
        info = slurm.job(job)
    finally:
        slurm.run(["scancel", str(job)])
    assert code == 0 and len(said) == 2, said
    assert said[0].startswith("time limit (") and f"saved at step 7; requeueing job {job}" in said[0]
    assert said[1].startswith(f"could not requeue job {job}: 'scontrol requeue {job}' failed: ") and \
        "disabled" in said[1] and "submit the job again" in said[1], said
    assert (info["JobState"], info["Restarts"]) == ("RUNNING", "0")
    assert not (tmp_path / "metrics.jsonl").exists()  # no requeue row for a requeue that did not happen
