"""``train_batch_size_schedule`` end to end: one rank, a tiny model, 6 steps of 2, 2, 6, 6, 4, 4 samples
(micro batch 2: 1, 1, 3, 3, 2, 2 micro-batches), checkpoints at 3 and 6, and a resume from step 3, in the
middle of the 6-sample segment, that must give the uninterrupted run's losses (fp32, 1e-6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_resume import MODEL_YML, assert_curves_match, deepy, losses, output

pytestmark = pytest.mark.slow

SCHEDULE = "[{start_step: 0, global_batch: 2}, {start_step: 2, global_batch: 6}, {start_step: 4, global_batch: 4}]"
BATCHES = [2, 2, 6, 6, 4, 4]
COMMON = ("num_gpus=1", "train_iters=6", "lr_decay_iters=6", "checkpoint_factor=3")


def rows(log_dir: Path) -> dict[int, dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines) if "train/lm_loss" in r}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("batch_schedule")
    (tmp / "model.yml").write_text(MODEL_YML.replace(
        "train_batch_size: 8\n", f"train_micro_batch_size_per_gpu: 2\ntrain_batch_size_schedule: {SCHEDULE}\n"))
    first = deepy(tmp, *COMMON, "save=ckpt", "log_dir=logs")
    assert first.returncode == 0, output(first)
    resumed = deepy(tmp, *COMMON, "load=ckpt", "iteration=3", "save=ckpt2", "log_dir=resumed")
    assert resumed.returncode == 0, output(resumed)
    (tmp / "first.out").write_text(output(first))
    (tmp / "resumed.out").write_text(output(resumed))
    return tmp


def test_each_step_runs_its_scheduled_batch(scheduled: Path) -> None:
    got = rows(scheduled / "logs")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    # the samples read (the data offset) and the batch DeepSpeed ran (its accumulation) follow the schedule
    assert [got[s]["consumed_samples"] for s in got] == [sum(BATCHES[:s]) for s in range(1, 7)]
    assert [got[s]["train/global_batch"] for s in got] == BATCHES
    assert [got[s]["train/consumed_tokens"] for s in got] == [32 * sum(BATCHES[:s]) for s in range(1, 7)]


def test_a_resume_in_the_middle_of_the_schedule_gives_the_uninterrupted_losses(scheduled: Path) -> None:
    resumed = losses(scheduled / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert rows(scheduled / "resumed")[4]["train/global_batch"] == 6
    assert_curves_match(resumed, losses(scheduled / "logs"), 1e-6)


def test_the_header_counts_the_tokens_of_each_steps_batch(scheduled: Path) -> None:
    """Issue 42 item 18: the header said train_iters x the first step's batch (6 x 2 x 32 = 384 tokens; a resume
    after a micro-batch change likewise stated 450,560 tokens for 245,760). The run reads 2+2+6+6+4+4 = 24
    samples of 32 tokens; the resumed one read 10 of them before step 3 and adds the 14 of its steps."""
    tokens = 32 * sum(BATCHES)
    first = next(line for line in (scheduled / "first.out").read_text().splitlines() if "  schedule " in line)
    assert f"6 steps, {tokens:,} tokens" in first, first
    resumed = next(line for line in (scheduled / "resumed.out").read_text().splitlines() if "  schedule " in line)
    assert f"6 steps (resuming after step 3: 3 to go), {tokens:,} tokens" in resumed, resumed
