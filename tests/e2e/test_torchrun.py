"""Deepy without deepy.py: ``torchrun ... train.py CONFIG...`` and DeepSpeed's runner with ``--no_ssh``, as clusters
without ssh between nodes (Kubernetes, SkyPilot) start jobs. Real processes: two torchrun agents on this machine
are two "nodes" (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on localhost); each worker resolves the config.

* Their per-step losses equal deepy.py's 2-rank launch of the same config (``reference_curve``) within 1e-6.
* ``--max-restarts 1`` with a ``kill -9`` of one worker at step 13: torchrun restarts both, they resume from the
  step-10 checkpoint and finish on the same curve.
* Nodes given different configs, and running different code, are refused on both nodes before training, naming
  the key (with each side's file:line or ``cli``) and the source file.
* DeepSpeed's runner with ``--no_ssh --node_rank K`` on each "node" trains on the same curve.
* ``launcher: torchrun``: deepy.py starts the agent, which restarts a killed rank.
* SIGTERM to every agent (a pod deletion) makes the workers save and stop.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import (
    REPO,
    TRAIN,
    TRAIN_ITERS,
    assert_curves_match,
    deepy_env,
    latest_step,
    losses,
    write_model,
)
from ports import free_port

pytestmark = pytest.mark.slow

FAULTS = str(Path(__file__).with_name("fault_train.py"))
SAVE = ("save=ckpt", "load=ckpt", "checkpoint_factor=10", "log_dir=logs")


def torchrun(port: int, script: str, *args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=deepy-test", f"--max-restarts={restarts}", script, *args]


def two_nodes(tmp: Path, node0: list[str], node1: list[str], env: dict[str, str] | None = None,
              env1: dict[str, str] | None = None, timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Both launchers at once (each a node), to their end."""
    procs = [subprocess.Popen(argv, cwd=tmp, env=deepy_env({**(env or {}), **(extra or {})}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for argv, extra in ((node0, None), (node1, env1))]
    done = []
    for argv, proc in zip((node0, node1), procs):
        out, _ = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, ""))
    return done


def test_two_torchrun_nodes_train_on_deepys_curve(tmp_path: Path, reference_curve: dict[int, float]) -> None:
    write_model(tmp_path)
    port = free_port()
    nodes = two_nodes(tmp_path, torchrun(port, TRAIN, "model.yml", *SAVE), torchrun(port, TRAIN, "model.yml", *SAVE))
    for node in nodes:
        assert node.returncode == 0, node.stdout[-4000:]
    out = nodes[0].stdout + nodes[1].stdout
    assert out.count("2 rank(s) started by torchrun on 2 node(s) agree on the config and code") == 1, out[-3000:]
    (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if p.is_dir()]  # one run name, agreed by both nodes
    assert (run_dir / "deepy_config.json").is_file()
    got = losses(tmp_path / "logs")
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1))
    assert_curves_match(got, reference_curve, 1e-6)


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_on_the_same_curve(
        tmp_path: Path, reference_curve: dict[int, float]) -> None:
    write_model(tmp_path)
    port = free_port()
    faults = {"DEEPY_FAULTS": "kill:1:13", "DEEPY_FAULT_MARKERS": str(tmp_path)}
    argv = torchrun(port, FAULTS, "model.yml", *SAVE, restarts=1)
    nodes = two_nodes(tmp_path, argv, argv, env=faults)
    out = nodes[0].stdout + nodes[1].stdout
    for node in nodes:
        assert node.returncode == 0, out[-6000:]
    assert (tmp_path / "fault0-kill-1-13").is_file(), "the kill never fired"
    assert "exitcode: -9" in out  # torchrun saw the SIGKILL
    assert "resumed from ckpt/global_step10 (iteration 10" in out
    rows = losses(tmp_path / "logs")
    assert sorted(rows) == list(range(1, TRAIN_ITERS + 1))
    assert_curves_match(rows, reference_curve, 1e-6)


def test_nodes_with_different_configs_or_code_are_refused_before_training(tmp_path: Path) -> None:
    write_model(tmp_path)
    # node 1 runs a copy of the repository with one source file changed, and another dropout
    other = tmp_path / "other"
    for part in ("megatron", "train.py", "deepy.py"):
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, other / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, other / part)
    changed = other / "megatron" / "training" / "loop.py"
    changed.write_text(changed.read_text() + "\n# a node with a local edit\n")
    port = free_port()
    nodes = two_nodes(tmp_path, torchrun(port, TRAIN, "model.yml", *SAVE),
                      torchrun(port, str(other / "train.py"), "model.yml", *SAVE, "hidden_dropout=0.2"),
                      env1={"PYTHONPATH": str(other)})
    for node in nodes:
        out = node.stdout
        assert node.returncode != 0, out[-3000:]
        assert "exitcode: 2" in out, out[-3000:]  # the workers' own exit code: a refusal
        assert "the ranks torchrun started disagree before training" in out, out[-3000:]
        assert "megatron/training/loop.py differs between rank 0" in out
        assert "hidden_dropout=0.1 on rank 0 (host " in out and "; model.yml:15) but 0.2 on rank 1 (host " in out
        assert "; cli)" in out
        assert "iteration 1/" not in out
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_deepspeeds_runner_without_ssh_starts_the_same_run(tmp_path: Path, reference_curve: dict[int, float]) -> None:
    write_model(tmp_path)
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")  # names only: nothing is reached by ssh
    port = free_port()

    def node(rank: int) -> list[str]:
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile=hostfile", "--no_ssh",
                f"--node_rank={rank}", "--master_addr=127.0.0.1", f"--master_port={port}", TRAIN, "model.yml",
                "log_dir=logs"]

    nodes = two_nodes(tmp_path, node(0), node(1), env={"DS_ACCELERATOR": "cpu"})
    for done in nodes:
        assert done.returncode == 0, done.stdout[-4000:]
    out = nodes[0].stdout + nodes[1].stdout
    assert "2 rank(s) started by DeepSpeed's launcher on 2 node(s) agree" in out, out[-3000:]
    assert_curves_match(losses(tmp_path / "logs"), reference_curve, 1e-6)


def test_config_files_without_a_launcher_say_how_to_start(tmp_path: Path) -> None:
    write_model(tmp_path)
    env = deepy_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, TRAIN, "model.yml"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "runs as a worker of torchrun or DeepSpeed's launcher" in done.stderr
    assert "python deepy.py" in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("deepy: usage error") == 1 or done.stderr.count("deepy:") == 1


def test_launcher_torchrun_restarts_a_killed_rank_through_torchrun(tmp_path: Path,
                                                                   reference_curve: dict[int, float]) -> None:
    """``launcher: torchrun`` with ``max_restarts: 1``: deepy.py starts torchrun's agent, which restarts the ranks
    after a ``kill -9`` (``--max-restarts=1``); deepy.py does not launch again."""
    write_model(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "deepy.py"), FAULTS, "model.yml", "launcher=torchrun", "num_gpus=2",
                           "max_restarts=1", *SAVE], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=deepy_env({"DEEPY_FAULTS": "kill:0:13", "DEEPY_FAULT_MARKERS": str(tmp_path)}))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "via local torchrun" in out and "-m torch.distributed.run --nnodes=1 --nproc-per-node=2" in out
    assert "--max-restarts=1" in out and "deepy: restart" not in out  # torchrun restarted, not deepy
    assert (tmp_path / "fault0-kill-0-13").is_file() and "exitcode: -9" in out
    assert "resumed from ckpt/global_step10 (iteration 10" in out
    assert_curves_match(losses(tmp_path / "logs"), reference_curve, 1e-6)


def test_sigterm_to_every_agent_saves_a_checkpoint_as_a_pod_deletion_would(tmp_path: Path) -> None:
    """Kubernetes deletes a pod with SIGTERM to its process: torchrun passes it on to its workers (torch 2.13
    ``_shutdown(e.sigval)``, 30 s before SIGKILL), which finish the step, save and exit 0."""
    import os
    import signal
    import time

    write_model(tmp_path)
    port = free_port()
    argv = torchrun(port, FAULTS, "model.yml", *SAVE)
    # slow steps (0.3 s per micro-batch on rank 0) so that the signal lands mid-run
    env = deepy_env({"DEEPY_FAULTS": "slow:0:0.3", "DEEPY_FAULT_MARKERS": str(tmp_path)})
    procs = [subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (metrics.is_file() and '"iteration": 3' in metrics.read_text()):
        time.sleep(0.2)
    for proc in procs:
        os.kill(proc.pid, signal.SIGTERM)
    out = "".join(proc.communicate(timeout=120)[0] for proc in procs)
    assert "preempted (SIGTERM); checkpoint saved" in out, out[-4000:]
    step = latest_step(tmp_path / "ckpt")
    assert 3 <= step < TRAIN_ITERS and max(losses(tmp_path / "logs")) == step
