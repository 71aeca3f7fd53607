"""``train_data_weights_schedule`` end to end: two jsonl sources given as train_data_paths entries (tokenized into
cache_dir at start-up), weights 3:1 for steps 1-4 and 1:3 from step 5 (data offset 32 = two blocks of 16), one rank
for 6 steps with a checkpoint at step 2; then a resume from step 2 at dp 2 (ZeRO-1) crosses the weight change and
must give the uninterrupted run's losses (fp32; dp changes only the order of the gradient sum, within
test_resume_layout's bound), i.e. read the same samples in the same order."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.e2e.test_resume import DP2, MODEL_YML, deepy, losses, output
from tests.e2e.test_resume_layout import TOL

pytestmark = pytest.mark.slow

MIXTURE = ("use_dummy_dataset: false\ntrain_data_paths: [a.jsonl, b.jsonl.gz]\ncache_dir: cache\n"
           "mixture_block_size: 16\ntrain_data_weights_schedule: [[0, [3, 1]], [4, [1, 3]]]\n")
COMMON = ("train_iters=6", "lr_decay_iters=6", "hidden_dropout=0.0")


def _write(tmp: Path) -> None:
    (tmp / "a.jsonl").write_text("".join(json.dumps({"text": "ab" * (10 + i % 7)}) + "\n" for i in range(60)))
    words = ["the quick brown fox {}".format(i) for i in range(60)]
    (tmp / "b.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": w}) + "\n" for w in words).encode()))
    (tmp / "model.yml").write_text(MODEL_YML.replace("use_dummy_dataset: true\n", MIXTURE))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("mixture")
    _write(tmp)
    first = deepy(tmp, "num_gpus=1", *COMMON, "save=ckpt", "checkpoint_factor=2", "log_dir=logs")
    assert first.returncode == 0, output(first)
    resumed = deepy(tmp, *DP2, *COMMON, "load=ckpt", "iteration=2", "save=ckpt2", "checkpoint_factor=100",
                    "log_dir=resumed")
    assert resumed.returncode == 0, output(resumed)
    return tmp


def test_a_resume_at_dp2_before_the_weight_change_reads_the_uninterrupted_samples(runs: Path) -> None:
    whole, resumed = losses(runs / "logs"), losses(runs / "resumed")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [3, 4, 5, 6]
    bad = {s: (resumed[s], whole[s]) for s in resumed if abs(resumed[s] - whole[s]) > TOL * max(1.0, whole[s])}
    assert not bad, bad
    assert len(list((runs / "cache").glob("urls_*_text_document.idx"))) == 2  # each jsonl entry tokenized once
