"""Session fixtures shared by the launch tests (test_launch_lifecycle.py, test_slurm.py, test_mpi.py)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import SAVE, TRAIN, losses, start_deepy, survivors, write_model


@dataclass
class TwoRuns:
    """Two training runs started at the same moment on this machine, neither choosing a port."""

    reference_dir: Path
    reference_code: int
    reference_output: str
    reference: dict[int, float]
    """The uninterrupted loss curve, step -> train/lm_loss."""
    stopped_dir: Path
    stopped_code: int
    stopped_output: str
    stopped_survivors: list[str]
    """Processes of the stopped run still alive the moment its deepy.py had exited."""


@pytest.fixture(scope="session")
def two_runs_at_once(tmp_path_factory: pytest.TempPathFactory) -> TwoRuns:
    """The reference run, and at the same moment a run that gets SIGTERM on deepy.py after step 3."""
    ref_dir, stop_dir = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("stopped")
    ref = start_deepy(ref_dir, TRAIN, str(write_model(ref_dir)), "num_gpus=2", "log_dir=logs")
    stop = start_deepy(stop_dir, TRAIN, str(write_model(stop_dir)), "num_gpus=2", "log_dir=logs1", *SAVE)
    stop.wait_for(r"^iteration 3/")
    os.kill(stop.proc.pid, signal.SIGTERM)
    stopped_code = stop.wait()
    left = survivors(stop_dir)
    ref_code = ref.wait()
    return TwoRuns(
        reference_dir=ref_dir,
        reference_code=ref_code,
        reference_output=ref.output,
        reference=losses(ref_dir / "logs") if ref_code == 0 else {},
        stopped_dir=stop_dir,
        stopped_code=stopped_code,
        stopped_output=stop.output,
        stopped_survivors=left,
    )


@pytest.fixture(scope="session")
def reference_curve(two_runs_at_once: TwoRuns) -> dict[int, float]:
    assert two_runs_at_once.reference_code == 0, two_runs_at_once.reference_output[-4000:]
    return two_runs_at_once.reference
