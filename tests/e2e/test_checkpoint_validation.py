"""``checkpoint_validation_with_forward_pass``: after each save the weights just written are read
back and must give the same loss on a fixed batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_resume import DP2, deepy, output

pytestmark = pytest.mark.slow


def test_checkpoint_validation_reloads_and_compares(tmp_path: Path) -> None:
    common = (*DP2, "train_iters=4", "save=ckpt", "checkpoint_factor=2", "checkpoint_validation_with_forward_pass=true")
    for name in ("good", "bad", "off"):
        (tmp_path / name).mkdir()
    good = deepy(tmp_path / "good", *common)
    assert good.returncode == 0, output(good)
    assert output(good).count("validated: reloaded weights give the same loss") == 2  # steps 2 and 4

    bad = deepy(tmp_path / "bad", *common, script=Path(__file__).with_name("corrupt_before_commit_train.py"),
                env={"CORRUPT_STEP": "2"})
    assert bad.returncode == 2, output(bad)
    assert "does not reproduce the model" in output(bad) and "Traceback" not in output(bad)
    # without the key nothing is re-read
    off = deepy(tmp_path / "off", *DP2, "train_iters=4", "save=ckpt", "checkpoint_factor=2",
                script=Path(__file__).with_name("corrupt_before_commit_train.py"), env={"CORRUPT_STEP": "2"})
    assert off.returncode == 0 and "validated" not in output(off), output(off)
