"""Deepy under Open MPI: ``launcher: openmpi`` makes ``mpirun`` start every rank (Debian's openmpi-bin).

* Two ranks train through mpirun on the uninterrupted loss curve (within 1e-6); SIGTERM to
  deepy.py reaches both through mpirun (as SIGUSR1, which mpirun passes on; it would kill the job
  on SIGTERM), they save a checkpoint and exit 0, deepy exits 0, nothing is left running.
  SIGUSR1 reaches the ranks the same way; the user's environment (a secret included) reaches
  them, on no command line.
* A rank that fails with exit code 3 makes deepy exit with 3.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from launch_helpers import (
    FAIL_WORKER,
    SAVE,
    STOP_WORKER,
    TRAIN,
    TRAIN_ITERS,
    assert_curves_match,
    command_lines_containing,
    latest_step,
    losses,
    ready_files,
    run_deepy,
    start_deepy,
    stopped_signals,
    survivors,
    write_model,
    write_script,
)

pytestmark = pytest.mark.slow

MPI = ("launcher=openmpi", "deepspeed_mpi=true", "num_gpus=2")
# Open MPI refuses to start ranks as root unless told so (CI machines run tests as root)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
SECRET = "mpi-test-secret-6262"


@pytest.fixture(autouse=True)
def open_mpi_installed() -> None:
    missing = [tool for tool in ("mpirun", "ompi_info") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: Debian's openmpi-bin is not installed (.ci/run installs it "
                    f"with 'apt-get install -y openmpi-bin'; that step failed or was not run on this machine)")


def test_mpirun_trains_and_stops_on_sigterm_to_deepy_with_a_checkpoint(tmp_path: Path, reference_curve: dict[int, float]) -> None:
    write_model(tmp_path)
    run = start_deepy(tmp_path, TRAIN, "model.yml", *MPI, "log_dir=logs1", *SAVE, env=ROOT_OK)
    run.wait_for(rf"^iteration 3/{TRAIN_ITERS}")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait() == 0, run.output[-4000:]
    out = run.output
    assert "via mpirun (openmpi)" in out and "mpirun -n 2 --host localhost:2" in out
    assert "deepy: stopped on SIGTERM: every rank stopped cleanly" in out
    assert "preempted (SIGUSR1); checkpoint saved" in out
    assert survivors(tmp_path) == []
    step = latest_step(tmp_path / "ckpt")
    assert 3 <= step < TRAIN_ITERS and max(losses(tmp_path / "logs1")) == step
    # the ranks mpirun started trained exactly as local ones do (resuming is launcher-independent:
    # test_launch_lifecycle.py and test_slurm.py resume and compare the rest of the curve)
    assert_curves_match(losses(tmp_path / "logs1"), reference_curve, 1e-6)


def test_sigusr1_reaches_every_rank_through_mpirun(tmp_path: Path) -> None:
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    env = {**ROOT_OK, "WANDB_API_KEY": SECRET}
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), *MPI, "log_dir=logs", env=env)
    places = ready_files(tmp_path, 2, run)
    assert {p["secret_seen"] for p in places} == {SECRET} and command_lines_containing(SECRET) == []
    assert [(p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for p in places] == [("0", "0", "2"), ("1", "1", "2")]
    assert {p["MASTER_ADDR"] for p in places} == {"127.0.0.1"} and len({p["MASTER_PORT"] for p in places}) == 1
    assert places[0]["MASTER_PORT"] != "29500"  # no master_port set: a free one
    os.kill(run.proc.pid, signal.SIGUSR1)
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert stopped_signals(tmp_path) == ["SIGUSR1", "SIGUSR1"]
    assert survivors(tmp_path) == []


def test_a_failing_rank_sets_deepys_exit_code(tmp_path: Path) -> None:
    worker = write_script(tmp_path, "fail_worker.py", FAIL_WORKER)
    done = run_deepy(tmp_path, worker, str(write_model(tmp_path)), *MPI, "log_dir=logs", "max_restarts=1", env=ROOT_OK,
                     timeout=200)  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "deepy: run failed with exit code 3" in done.stdout
    # issue 43: max_restarts runs mpirun again; the rank fails again, and deepy gives up with its code
    assert done.stdout.count("deepy: starting 2 ranks via mpirun") == 2 and "deepy: restart 1 of 1: " in done.stdout
    assert "deepy: giving up after 1 restart (max_restarts=1)" in done.stdout
    assert survivors(tmp_path) == []
