"""Checkpoints written by earlier code load and resume exactly (issue 46: the refactor keeps them).

The code of EARLIER (the last commit before issue 46's refactor, taken from this clone's history with
``git archive``) trains test_resume.py's tiny model on CPU, one rank at ZeRO-1 with dropout on, 4 steps,
saving at steps 2 and 4. This checkout's code then resumes from step 2 and must reproduce the earlier
code's own losses at steps 3 and 4 and its step-4 weights, and loads the step-4 checkpoint and goes on
from iteration 4. The earlier code's step 4 is the reference: no run of the current code is trusted to
make it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port
from test_resume import REPO, assert_curves_match, deepy, losses, output, write_config

pytestmark = pytest.mark.slow

EARLIER = "309c0597c47d96e0015a5a91ae3c61f7a76b3b46"
"""The last commit before issue 46's refactor (engine/, pretrain, RunConfig)."""
SINGLE = ("num_gpus=1", "model_parallel_size=1", "pipe_parallel_size=1", "zero_optimization={stage: 1}",
          "hidden_dropout=0.1", "lr_decay_iters=4")  # fmt: skip


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The earlier code's 4 steps: ``ckpt/global_step2``, ``ckpt/global_step4`` and ``logs/`` (every step's loss)."""
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{EARLIER}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"commit {EARLIER[:7]} (the code before issue 46's refactor) is not in this clone's history "
                    "(a shallow clone?): `git fetch --unshallow` to run this test")  # fmt: skip
    code = tmp_path_factory.mktemp("earlier_code")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", EARLIER], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    env.pop("DEEPY_DEBUG", None)
    where = subprocess.run([sys.executable, "-c", "import megatron; print(megatron.__file__)"], cwd=code, env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(code), where.stdout  # the ranks import the earlier code

    run = tmp_path_factory.mktemp("earlier_run")
    config = write_config(run)
    proc = subprocess.run(
        [sys.executable, str(code / "deepy.py"), str(code / "train.py"), str(config), *SINGLE, "train_iters=4",
         f"save={run / 'ckpt'}", "checkpoint_factor=2", f"log_dir={run / 'logs'}", f"master_port={free_port()}"],
        cwd=code, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, output(proc)
    assert sorted(losses(run / "logs")) == [1, 2, 3, 4]
    assert all((run / "ckpt" / f"global_step{step}" / "COMMITTED").is_file() for step in (2, 4))
    return run


def test_the_current_code_resumes_the_earlier_step_2_on_the_earlier_losses(tmp_path: Path, earlier_run: Path) -> None:
    import torch

    proc = deepy(tmp_path, *SINGLE, "train_iters=4", f"load={earlier_run / 'ckpt'}", "iteration=2", "save=ckpt",
                 "checkpoint_factor=2", "log_dir=logs")  # fmt: skip
    assert proc.returncode == 0, output(proc)
    assert "resumed from" in output(proc) and "(iteration 2, consumed samples 16)" in output(proc)
    resumed, earlier = losses(tmp_path / "logs"), losses(earlier_run / "logs")
    assert sorted(resumed) == [3, 4]  # continued at step 3, not restarted
    assert_curves_match(resumed, {step: earlier[step] for step in (3, 4)}, 1e-6)
    # and step 4's update is the same: the weights it saves equal the earlier code's step-4 weights
    theirs = sorted((earlier_run / "ckpt" / "global_step4").glob("layer_*-model_states.pt"))
    ours = tmp_path / "ckpt" / "global_step4"
    assert theirs
    for path in theirs:
        want, got = torch.load(path, weights_only=False), torch.load(ours / path.name, weights_only=False)
        assert sorted(got) == sorted(want), path.name
        assert all(torch.equal(got[k], want[k]) for k in want), path.name


def test_the_current_code_loads_the_earlier_step_4_and_goes_on_from_iteration_4(tmp_path: Path,
                                                                                earlier_run: Path) -> None:  # fmt: skip
    assert (earlier_run / "ckpt" / "latest").read_text().strip() == "global_step4"
    proc = deepy(tmp_path, *SINGLE, "train_iters=5", f"load={earlier_run / 'ckpt'}", "log_dir=logs")
    assert proc.returncode == 0, output(proc)
    assert "(iteration 4, consumed samples 32)" in output(proc), output(proc)
    assert sorted(losses(tmp_path / "logs")) == [5]
