"""Deepy over pdsh + ssh, for real: an sshd of the test's own (throwaway keys, a free port on
127.0.0.1) stands in for the other nodes, and DeepSpeed's runner reaches "localhost" through pdsh.

* The ranks start through pdsh with the user's ssh options (``PDSH_SSH_ARGS_APPEND``, added to by
  nothing and replaced by nothing), find their place and rendezvous, and see the user's PYTHONPATH.
* A secret forwarded with ssh's ``SendEnv`` reaches the ranks and shows on no command line.
* SIGTERM to deepy.py reaches every rank through pdsh; they exit 0 and so does deepy.
* A rank that fails with exit code 3 makes deepy exit with 3 (pdsh ``-S`` passes it on).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import (
    FAIL_WORKER,
    REPO,
    STOP_WORKER,
    command_lines_containing,
    ready_files,
    run_deepy,
    start_deepy,
    stopped_signals,
    survivors,
    write_model,
    write_script,
)

pytestmark = pytest.mark.slow

SECRET = "pdsh-test-secret-7373"
TOOLS = ("pdsh", "ssh", "ssh-keygen", "/usr/sbin/sshd")


@pytest.fixture(scope="module")
def ssh_args(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start a private sshd; yield the PDSH_SSH_ARGS_APPEND a user would set to reach it."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: Debian's pdsh/openssh-server are not installed (.ci/run "
                    f"installs them with 'apt-get install -y pdsh openssh-server'; that step failed or was not run)")
    root = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root}/host_key\nAuthorizedKeysFile {root}/authorized_keys\n"
        f"PidFile {root}/sshd.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nAcceptEnv WANDB_API_KEY\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory, made by its package
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")],
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert sshd.poll() is None, (root / "sshd.log").read_text()
            time.sleep(0.1)
        yield (f"-p {port} -i {root}/client_key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
               f"-o LogLevel=ERROR -o BatchMode=yes")  # fmt: skip
    finally:
        sshd.terminate()
        sshd.wait(timeout=30)


def pdsh_run(tmp: Path) -> tuple[str, ...]:
    """One host, reached through pdsh anyway (force_multi); rank 0 is here, so deepy names the address."""
    (tmp / "hostfile").write_text("localhost slots=2\n")
    return ("hostfile=hostfile", "force_multi=true", "no_ssh_check=true", "log_dir=logs")


def test_ranks_start_through_pdsh_and_stop_on_sigterm_to_deepy(ssh_args: str, tmp_path: Path) -> None:
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    env = {"PDSH_SSH_ARGS_APPEND": f"{ssh_args} -o SendEnv=WANDB_API_KEY", "WANDB_API_KEY": SECRET,
           "PYTHONPATH": f"{REPO}:/opt/user-lib"}  # fmt: skip
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), *pdsh_run(tmp_path), env=env)
    places = ready_files(tmp_path, 2, run)
    assert "via pdsh" in run.output
    assert [(p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for p in places] == [("0", "0", "2"), ("1", "1", "2")]
    assert {p["MASTER_ADDR"] for p in places} == {"127.0.0.1"} and len({p["MASTER_PORT"] for p in places}) == 1
    assert places[0]["MASTER_PORT"] != "29500"  # no master_port set: a free one
    assert all("/opt/user-lib" in str(p["pythonpath"]).split(":") for p in places)
    assert {p["secret_seen"] for p in places} == {SECRET}  # by ssh's SendEnv, not on a command line
    assert command_lines_containing(SECRET) == []

    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert stopped_signals(tmp_path) == ["SIGUSR1", "SIGUSR1"]
    assert "deepy: stopped on SIGTERM: every rank stopped cleanly" in run.output
    assert survivors(tmp_path, wait_s=10) == []


def test_a_failing_rank_sets_deepys_exit_code_through_pdsh(ssh_args: str, tmp_path: Path) -> None:
    worker = write_script(tmp_path, "fail_worker.py", FAIL_WORKER)
    done = run_deepy(tmp_path, worker, str(write_model(tmp_path)), *pdsh_run(tmp_path),
                     "max_restarts=1", env={"PDSH_SSH_ARGS_APPEND": ssh_args}, timeout=200)  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "deepy: run failed with exit code 3" in done.stdout
    # issue 43: max_restarts runs DeepSpeed's runner (pdsh) again; the rank fails again, and deepy gives up
    assert done.stdout.count("deepy: starting 2 ranks via pdsh") == 2 and "deepy: restart 1 of 1: " in done.stdout
    assert "deepy: giving up after 1 restart (max_restarts=1)" in done.stdout
    assert survivors(tmp_path, wait_s=10) == []


def test_launcher_torchrun_starts_an_agent_on_every_host_through_pdsh(ssh_args: str, tmp_path: Path) -> None:
    """issue 45: ``launcher: torchrun`` over a hostfile of two hosts (both this machine, through its sshd): pdsh
    starts a torchrun agent on each, the agents meet at the first host and start one rank each; SIGTERM to deepy
    reaches the ranks (not the agents) through pdsh, and everything ends cleanly."""
    worker = write_script(tmp_path, "stop_worker.py", STOP_WORKER)
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = {"PDSH_SSH_ARGS_APPEND": ssh_args}
    run = start_deepy(tmp_path, worker, str(write_model(tmp_path)), "launcher=torchrun", "hostfile=hostfile",
                      "master_addr=127.0.0.1", "no_ssh_check=true", "log_dir=logs", env=env)
    places = ready_files(tmp_path, 2, run)
    assert "via pdsh + torchrun" in run.output and "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d" in run.output
    assert sorted((p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for p in places) == [("0", "0", "2"), ("1", "0", "2")]
    assert len({p["MASTER_PORT"] for p in places}) == 1
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.output[-4000:]
    assert stopped_signals(tmp_path) == ["SIGUSR1", "SIGUSR1"]
    assert "deepy: stopped on SIGTERM: every rank stopped cleanly" in run.output
    assert survivors(tmp_path, wait_s=10) == []
