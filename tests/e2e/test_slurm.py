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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import (
    FAIL_WORKER,
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
           env: dict[str, str] | None = None) -> int:  # fmt: skip
    job_env = deepy_env({**slurm.env, "PYTHON": __import__("sys").executable, "DEEPY_HOME": str(REPO), **(env or {})})
    if script:
        job_env["DEEPY_SCRIPT"] = script
    return slurm.sbatch([*TWO_NODES, f"--output={tmp}/job-%j.out", SBATCH, *args], cwd=tmp, env=job_env)


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
    job = submit(slurm, tmp_path, str(write_model(tmp_path)), "log_dir=logs", script=str(worker))
    info = slurm.wait_job(job, timeout=300)
    out = job_output(tmp_path, job)
    assert info["JobState"] == "FAILED", out
    assert "task 1: Exited with exit code 3" in out  # srun names the failed rank's code
    # srun's own code is its tasks' highest: rank 0, which it stopped with SIGTERM, counts as 143
    assert "deepy: run failed with exit code 143" in out and info["ExitCode"] == "143:0"
    assert time.monotonic() - started < 100  # rank 0 was stopped, not left to sleep for 120 s
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
