"""Packed documents kept apart, end to end: ``deepy.py`` runs on a packed corpus of short documents.

The corpus is many short documents, each ending with the end-of-document token, packed into
``seq_length + 1`` samples (``pack_impl: packed``), so most samples hold several documents. With
``reset_attention_mask`` and ``reset_position_ids`` every layout must give the single-rank per-step
losses (the micro-batch's document ids travel through the runner, the pipeline and tensor-parallel
attention), and those losses must differ from the run without the keys (the keys are honoured).
The model-level property - each document's loss and gradients equal those of the document alone -
is tests/unit/test_document_mask.py and tests/distributed/test_document_mask_parallel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_parity import BASE_CONFIG, deepy, free_port

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path

RTOL = 1e-5
DOCUMENTS = {"reset_attention_mask": True, "reset_position_ids": True, "eod_mask_loss": True}
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"num_gpus": 2, "model_parallel_size": 2},
    "pp2": {"num_gpus": 2, "pipe_parallel_size": 2},
}


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


def train(tmp: Path, corpus: str, **overrides: Any) -> list[float]:
    config = {**BASE_CONFIG, "use_dummy_dataset": False, "data_path": corpus, "split": "98,2,0",
              "pos_emb": "learned", "train_iters": 6, "eval_interval": 1000, "num_gpus": 1,
              **overrides, "log_dir": str(tmp / "logs"), "master_port": free_port()}
    proc = deepy(config, tmp)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    import json

    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [row["train/lm_loss"] for row in rows if "train/lm_loss" in row]


@pytest.fixture(scope="module")
def single(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train(tmp_path_factory.mktemp("single"), corpus, **DOCUMENTS)


def test_document_keys_change_the_run(corpus: str, single: list[float], tmp_path: Path) -> None:
    plain = train(tmp_path, corpus, eod_mask_loss=True)
    assert len(plain) == len(single) == 6
    assert abs(plain[0] - single[0]) > 1e-3  # the first step already sees other documents' tokens


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_document_masked_layout_matches_single_rank(layout: str, corpus: str, single: list[float],
                                                    tmp_path: Path) -> None:
    got = train(tmp_path, corpus, **DOCUMENTS, **LAYOUTS[layout])
    np.testing.assert_allclose(got, single, rtol=RTOL, atol=0)
