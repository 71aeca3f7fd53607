"""Token ids beyond the vocabulary (issue 30, newcomer finding: they crashed rank 0 with an IndexError
traceback): refused before launch where the files are on this machine, and by the ranks for every sample,
each time naming the dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
from megatron.errors import DataError

REPO = Path(__file__).resolve().parents[2]
DOCS = [[5, 6, 7, 8, 9] * 8, [10, 11, 600, 12] * 10, [13, 14] * 20]
"""Sequence 1 holds id 600; CharLevelTokenizer has 512 tokens (and the model 512 rows)."""


def write(prefix: Path, docs: list[list[int]]) -> str:
    builder = MMapIndexedDatasetBuilder(data_file_path(str(prefix)), np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(index_file_path(str(prefix)))
    return str(prefix)


def test_dry_run_names_the_dataset_and_the_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    good, bad = write(tmp_path / "good", DOCS[::2]), write(tmp_path / "bad", DOCS)
    config = tmp_path / "run.yml"
    config.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 16\ntrain_iters: 2\n"
                      "lr: 0.001\ntrain_micro_batch_size_per_gpu: 2\nnum_gpus: 1\ntokenizer_type: CharLevelTokenizer\n"
                      f"train_data_paths: [{good}, {bad}]\n")
    argv = ["--dry-run", str(REPO / "train.py"), str(config)]
    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert done.value.code == 2 and "Traceback" not in text, text
    assert f"train_data_paths ({config}:10): dataset {bad} holds token id 600 (sequence 1)" in text, text
    assert "tokenizer_type='CharLevelTokenizer'" in text and "has 512 tokens" in text and str(good) + " " not in text


def test_ranks_refuse_a_sample_beyond_the_embedding(tmp_path: Path) -> None:
    from megatron.data.build import build_datasets
    from megatron.neox_arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run

    bad = write(tmp_path / "bad", DOCS)
    splits = build_datasets(data_run(NeoXArgs(seq_length=16, seed=1, train_batch_size=2, train_iters=8, eval_iters=0,
                                              train_data_paths=[bad], pack_impl="unpacked")), None, 512)
    clean, refused = 0, []
    for i in range(len(splits.train)):
        try:
            splits.train[i]
            clean += 1
        except DataError as err:
            refused.append(err.message)
    assert clean and refused, (clean, refused)  # the samples of documents 0 and 2 read as before
    assert f"of text {bad} holds token id 600, but the model's embedding has 512 rows" in refused[0]
