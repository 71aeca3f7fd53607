"""A local run's life through deepy.py: two runs at once, stop requests, a busy port.

* Two training runs started at the same moment on one machine, neither setting ``master_port``,
  both train (each picks its own free rendezvous port).
* SIGTERM to deepy.py (what ``kill``, ``docker stop`` and systemd send): every rank saves a
  checkpoint and exits 0, deepy exits 0, no process of the run survives, and the resumed run
  continues the uninterrupted loss curve exactly.
* SIGINT (Ctrl-C) and SIGHUP to deepy are stop requests too (SIGUSR1: test_mpi.py); a second
  request stops the ranks at once. A request while the ranks are still starting ends them (nothing
  trained, nothing lost) instead of killing them with SIGUSR1's default action. The user's
  environment reaches the ranks, secrets on no command line.
* A busy ``master_port`` set by the user is a config error naming the key, before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import TwoRuns
from launch_helpers import (
    REPO,
    SAVE,
    SLOW_START_WORKER,
    STOP_WORKER,
    STUBBORN_WORKER,
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
    wait_for_files,
    write_model,
    write_script,
)

pytestmark = pytest.mark.slow

SECRET = "local-test-secret-5151"

PORT = re.compile(r"^deepy: starting 2 ranks on this machine \(rendezvous 127\.0\.0\.1:(\d+)\)", re.MULTILINE)


def test_two_runs_started_together_both_train(two_runs_at_once: TwoRuns) -> None:
    runs = two_runs_at_once
    assert runs.reference_code == 0, runs.reference_output[-4000:]
    assert sorted(runs.reference) == list(range(1, TRAIN_ITERS + 1))
    ports = {int(PORT.search(out).group(1)) for out in (runs.reference_output, runs.stopped_output)}  # type: ignore[union-attr]
    assert len(ports) == 2 and 29500 not in ports
    assert "EADDRINUSE" not in runs.reference_output + runs.stopped_output


def test_sigterm_to_deepy_saves_a_checkpoint_and_the_run_resumes_exactly(
    two_runs_at_once: TwoRuns, reference_curve: dict[int, float]
) -> None:
    runs = two_runs_at_once
    out = runs.stopped_output
    assert runs.stopped_code == 0, out[-4000:]
    assert "deepy: stopped on SIGTERM: every rank stopped cleanly" in out
    assert "preempted (SIGUSR1)" in out, out[-4000:]
    assert runs.stopped_survivors == []
    tmp = runs.stopped_dir
    step = latest_step(tmp / "ckpt")
    assert 3 <= step < TRAIN_ITERS
    assert max(losses(tmp / "logs1")) == step

    resumed = run_deepy(tmp, TRAIN, "model.yml", "num_gpus=2", "log_dir=logs2", *SAVE)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    curve = losses(tmp / "logs2")
    assert sorted(curve) == list(range(step + 1, TRAIN_ITERS + 1))
    assert_curves_match(losses(tmp / "logs1"), reference_curve, 1e-6)
    assert_curves_match(curve, reference_curve, 1e-6)


def test_sigint_to_deepy_reaches_every_rank(tmp_path: Path) -> None:
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    env = {"WANDB_API_KEY": SECRET, "PYTHONPATH": f"{REPO}:/opt/user-lib"}
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), "num_gpus=2", "log_dir=logs", env=env)
    places = ready_files(tmp_path, 2, run)
    assert [p["RANK"] for p in places] == ["0", "1"]
    # the user's environment reaches the ranks: secrets by environment only, PYTHONPATH added to
    assert {p["secret_seen"] for p in places} == {SECRET} and command_lines_containing(SECRET) == []
    assert all("/opt/user-lib" in str(p["pythonpath"]).split(":") for p in places)
    os.kill(run.proc.pid, signal.SIGINT)  # Ctrl-C
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert stopped_signals(tmp_path) == ["SIGUSR1", "SIGUSR1"]
    assert "deepy: stopped on SIGINT: every rank stopped cleanly" in run.output
    assert survivors(tmp_path) == []


def test_a_second_stop_request_stops_the_ranks_at_once(tmp_path: Path) -> None:
    worker = write_script(tmp_path, "stubborn_worker.py", STUBBORN_WORKER)
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), "num_gpus=2", "log_dir=logs")
    ready_files(tmp_path, 2, run)
    os.kill(run.proc.pid, signal.SIGHUP)  # the terminal closed: a stop request like the others
    run.wait_for("SIGHUP: asking every rank to finish its step")
    time.sleep(2)
    assert run.proc.poll() is None  # the ranks ignore the request: the run goes on
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 128 + signal.SIGHUP, run.output[-4000:]
    assert "stopping the ranks now, without saving" in run.output
    assert stopped_signals(tmp_path) == []  # never got to finish on their own
    assert survivors(tmp_path) == []


def test_a_stop_request_while_the_ranks_start_stops_the_run_before_it_began(tmp_path: Path) -> None:
    """Issue 42 item 9: SIGTERM to deepy while its ranks are still starting (no stop handler yet) used to kill
    them with SIGUSR1's default action ("the ranks ended with exit code 138", deepy exit 143)."""
    worker = write_script(tmp_path, "slow_start_worker.py", SLOW_START_WORKER)
    # fresh interpreters: the stand-in needs no torch, which a forking launcher would import first
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), "num_gpus=2", "log_dir=logs",
                      env={"DEEPY_FORK_RANKS": "0"})
    run_dir = Path(run.wait_for(r"^deepy: resolved config written to (\S+)/deepy_config\.json").group(1))
    wait_for_files([tmp_path / run_dir / "started.0", tmp_path / run_dir / "started.1"])
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert "deepy: stopped on SIGTERM before the run began (the ranks were still starting): nothing was trained " \
           "or saved, nothing is lost" in run.output
    assert "exit code 138" not in run.output and "SIGUSR1" not in run.output
    assert survivors(tmp_path) == []


def test_a_stop_request_reaching_starting_train_ranks_ends_them_cleanly(tmp_path: Path) -> None:
    """Issue 42 item 9, the route of srun and mpirun: they pass SIGUSR1 on to every rank at once, also to ranks
    still importing torch. train.py catches it from its first line (``catch_until_training``): each rank ends with
    exit code 0 and one line says nothing was trained or saved. Before, SIGUSR1's default action killed them
    (exit code 138), or, reached after the watcher was set up, they trained a step and saved it."""
    import psutil

    from megatron.launcher.processes import survives

    run = start_deepy(tmp_path, TRAIN, str(write_model(tmp_path)), "num_gpus=2", "log_dir=logs", *SAVE,
                      env={"DEEPY_FORK_RANKS": "0"})  # fresh interpreters: seconds of imports before a step
    run_dir = Path(run.wait_for(r"^deepy: resolved config written to (\S+)/deepy_config\.json").group(1))
    config = str(run_dir / "deepy_config.json")  # as deepy.py names it to the ranks
    deadline = time.monotonic() + 120
    ranks: list[int] = []
    while len(ranks) < 2 or not all(survives(pid, signal.SIGUSR1) for pid in ranks):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output[-4000:]
        ranks = []
        for proc in psutil.Process(run.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # a helper process that just ended
                argv = proc.cmdline()
                if config in argv and any(arg.startswith("--local_rank=") for arg in argv):  # not their launcher
                    ranks.append(proc.pid)
        time.sleep(0.01)
    for pid in ranks:  # as srun does: straight to the ranks, not through deepy
        os.kill(pid, signal.SIGUSR1)
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert run.output.count("SIGUSR1 while the ranks were starting: stopping before the run began; nothing was "
                            "trained or saved") == 1, run.output[-4000:]
    assert "exit code 138" not in run.output and "iteration 1/" not in run.output
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("global_step*"))
    assert survivors(tmp_path) == []


def test_a_busy_master_port_is_a_config_error(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        done = run_deepy(tmp_path, TRAIN, str(write_model(tmp_path)), "num_gpus=2", f"master_port={busy}",
                         "log_dir=logs", timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"master_port={busy} is already in use on this machine" in done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stdout
    assert not (tmp_path / "logs").exists()  # nothing written, nothing started
