"""Streaming end to end through ``deepy.py`` (four launches): a streamed run (``stream_shards: 1``) at dp 2 saved at
step 3, resumed at tp 2 (dp 1) and saved at step 6, then resumed as a 2-stage pipeline, gives, step for step, the
losses of the offline path over the same jsonl shards with ``data_shuffle: false`` at dp 1 (the order both define
alike: documents in file order, packed, in the first epoch), and the checkpoint holds the stream's position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_resume import MODEL_YML, deepy, losses, output

pytestmark = pytest.mark.slow

STEPS = 9
TOL = 2e-5
"""Relative: tp 2 and dp 2 sum in another order than one rank (test_resume_layout.py's bound)."""


def _corpus(tmp: Path) -> str:
    rng = np.random.default_rng(7)
    words = ["the", "model", "reads", "streams", "of", "text", "while", "training", "and", "resumes", "exactly"]
    docs = [" ".join(words[int(i)] for i in rng.integers(0, len(words), int(rng.integers(3, 40)))) for _ in range(80)]
    (tmp / "part-0.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]))
    (tmp / "part-1.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[40:]))
    assert sum(len(d) + 1 for d in docs) > STEPS * 8 * 32 + 1  # the steps stay in the first epoch
    return str(tmp / "part-{0..1}.jsonl")


def _config(tmp: Path) -> None:
    text = MODEL_YML.replace("use_dummy_dataset: true\n", "").replace("train_iters: 12", f"train_iters: {STEPS}")
    (tmp / "model.yml").write_text(text.replace("lr_decay_iters: 12", f"lr_decay_iters: {STEPS}"))


def test_a_streamed_run_resumed_at_another_layout_matches_the_offline_file_order(tmp_path: Path) -> None:
    urls = _corpus(tmp_path)
    common = (f"train_urls=['{urls}']", "hidden_dropout=0.0", "zero_optimization={stage: 1}")
    streamed, offline = tmp_path / "streamed", tmp_path / "offline"
    for d in (streamed, offline):
        d.mkdir()
        _config(d)
    stream = (*common, "streaming=true", "stream_shards=1", "save=ckpt", "load=ckpt", "checkpoint_factor=3")
    first = deepy(streamed, *stream, "num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=1", "exit_interval=3",
                  "log_dir=logs0")
    assert first.returncode == 0, output(first)
    meta = json.loads((streamed / "ckpt" / "global_step3" / "deepy_meta.json").read_text())
    state = meta["extra"]["train_state"]["stream"]
    assert state["consumed_samples"] == 24 and state["stream_shards"] == 1 and state["streams"][0] != [0, 0]
    second = deepy(streamed, *stream, "num_gpus=2", "model_parallel_size=2", "pipe_parallel_size=1", "exit_interval=6",
                   "log_dir=logs1")
    assert second.returncode == 0, output(second)
    assert "layout changed from" in output(second), output(second)
    # a pipeline's first and last stages both read the data, both from the saved positions
    third = deepy(streamed, *stream, "num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=2", "log_dir=logs2")
    assert third.returncode == 0, output(third)
    assert "layout changed from" in output(third), output(third)
    reference = deepy(offline, *common, "data_shuffle=false", f"cache_dir={tmp_path / 'cache'}", "num_gpus=1",
                      "model_parallel_size=1", "pipe_parallel_size=1", "log_dir=logs")
    assert reference.returncode == 0, output(reference)
    want = losses(offline / "logs")
    got = {**losses(streamed / "logs0"), **losses(streamed / "logs1"), **losses(streamed / "logs2")}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    bad = {s: (got[s], want[s]) for s in want if abs(got[s] - want[s]) > TOL * abs(want[s])}
    assert not bad, f"streamed losses differ from the offline file order at steps {bad}"
