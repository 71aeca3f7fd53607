"""Long context end to end: packed documents kept apart and context parallelism, by ``deepy.py``.

The corpus is many short documents, each ending with the end-of-document token, packed into
``seq_length + 1`` samples (``pack_impl: packed``), so most samples hold several documents. The
single-rank run with ``reset_attention_mask`` / ``reset_position_ids`` is the reference; cp2·tp2,
cp2·pp2 and cp2·dp2 ZeRO-3 with the document masks, and cp2·dp2 ZeRO-1 without them (against the
single-rank run without the keys), must give its per-step losses within 1e-5 (relative). A run saved
at cp2 (ZeRO-1) after 3 steps resumes at cp1 and continues the single-rank curve. Without the keys
the losses differ (the keys are honoured). (Each launch costs 20-60 s on 2 cores, so every layout runs
once; the other mask setting of each layout is covered in-process by test_context_parallel.py, and
all 4 layouts x both settings passed once when this was written, 8.5 min.)

The model-level properties - each document's loss and gradients equal those of the document alone
(tp2, pp2), and context-parallel attention's loss and gradients equal one rank's (with and without
document masks, cp2 and cp2·tp2) - are tests/unit/test_document_mask.py,
tests/distributed/test_document_mask_parallel.py and tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_parity import BASE_CONFIG, deepy

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path

pytestmark = pytest.mark.slow

RTOL = 1e-5
STEPS = 6
DOCUMENTS = {"reset_attention_mask": True, "reset_position_ids": True}
LAYOUTS: dict[str, dict[str, Any]] = {
    # recomputing the blocks (document ids and positions ride along as checkpointed inputs)
    "cp2_tp2": {"num_gpus": 4, "context_parallel_size": 2, "model_parallel_size": 2, "checkpoint_activations": True},
    "cp2_pp2": {"num_gpus": 4, "context_parallel_size": 2, "pipe_parallel_size": 2, "checkpoint_activations": True},
    "cp2_dp2_zero3": {"num_gpus": 4, "context_parallel_size": 2, "zero_optimization": {"stage": 3}},
}
ZERO1 = {"num_gpus": 4, "context_parallel_size": 2, "zero_optimization": {"stage": 1}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Documents of 3 to 20 tokens (bytes 1..255, then the CharLevelTokenizer's EOD 0)."""
    prefix = tmp_path_factory.mktemp("packed") / "docs_text_document"
    rng = np.random.default_rng(7)
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(400):
        doc = rng.integers(1, 256, int(rng.integers(3, 21)))
        doc[-1] = 0
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return str(prefix)


def train(tmp: Path, corpus: str, **overrides: Any) -> tuple[dict[int, float], str]:
    """(step -> loss, the run's output); learned positions, so reset_position_ids matters."""
    config = {**BASE_CONFIG, "use_dummy_dataset": False, "data_path": corpus, "split": "98,2,0",
              "pos_emb": "learned", "train_iters": STEPS, "eval_interval": 1000, "num_gpus": 1,
              **overrides, "log_dir": str(tmp / "logs")}  # no master_port: deepy picks a free one
    tmp.mkdir(parents=True, exist_ok=True)
    proc = deepy(config, tmp)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}, out


def assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert got and set(got) <= set(want), (got, want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def single(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return train(tmp_path_factory.mktemp("single"), corpus, **DOCUMENTS)[0]


@pytest.fixture(scope="module")
def single_plain(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return train(tmp_path_factory.mktemp("single_plain"), corpus)[0]


def test_document_keys_change_the_run(single: dict[int, float], single_plain: dict[int, float]) -> None:
    assert len(single) == len(single_plain) == STEPS
    assert abs(single[1] - single_plain[1]) > 1e-3  # the first step already sees other documents' tokens


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_layout_with_document_masks_matches_single_rank(
        layout: str, corpus: str, single: dict[int, float], tmp_path: Path) -> None:  # fmt: skip
    assert_same(train(tmp_path, corpus, **DOCUMENTS, **LAYOUTS[layout])[0], single)


def test_context_parallel_without_document_masks_matches_single_rank(
        corpus: str, single_plain: dict[int, float], tmp_path: Path) -> None:  # fmt: skip
    assert_same(train(tmp_path, corpus, **ZERO1)[0], single_plain)


def test_resume_from_cp2_at_cp1_continues_the_curve(corpus: str, single: dict[int, float], tmp_path: Path) -> None:
    # ZeRO-1 partitions the optimizer state over the cp2 ranks: loading at cp1 must regroup it
    save = {"save": str(tmp_path / "ckpt"), "load": str(tmp_path / "ckpt"), "checkpoint_factor": 3,
            "zero_optimization": {"stage": 1}}
    first, _ = train(tmp_path / "cp2", corpus, **DOCUMENTS, **save, num_gpus=2, context_parallel_size=2,
                     exit_interval=3)
    assert sorted(first) == [1, 2, 3]
    second, out = train(tmp_path / "cp1", corpus, **DOCUMENTS, **save)
    assert sorted(second) == [4, 5, 6], out[-3000:]
    assert "layout changed from" in out and "resumed from" in out, out[-3000:]
    assert_same(first | second, single)
