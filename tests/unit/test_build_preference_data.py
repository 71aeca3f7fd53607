"""tools/datasets/build_preference_data.py: pairs from a text corpus, tokenized, plus a config overlay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError
from megatron.neox_arguments import NeoXArgs

from tools.datasets import build_preference_data as tool


def _corpus(path: Path, n: int = 20) -> Path:
    texts = [" ".join(f"w{i}x{j}" for j in range(30)) for i in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_pairs_prefer_the_true_continuation(tmp_path: Path) -> None:
    pairs = tool.make_pairs(tool.read_texts(_corpus(tmp_path / "c.jsonl"), 10), 4, 5, seed=3)
    assert len(pairs) == 20
    for i, pair in enumerate(pairs):
        assert pair["prompt"] == " ".join(f"w{i}x{j}" for j in range(4)) + " "
        assert pair["chosen"] == " ".join(f"w{i}x{j}" for j in range(4, 9))
        assert not pair["rejected"].startswith(f"w{i}x") and len(pair["rejected"].split()) == 5
    shuffled = tool.make_pairs(tool.read_texts(_corpus(tmp_path / "c.jsonl"), 10), 4, 5, seed=3, rejected="shuffled")
    for pair in shuffled:  # the same words, in another order
        assert sorted(pair["rejected"].split()) == sorted(pair["chosen"].split()) != pair["rejected"].split()
    kto = tool.as_kto(pairs[:2])
    assert [row["reward"] for row in kto] == [True, False, True, False]


@pytest.mark.parametrize("fmt", ["pairwise", "reward"])
def test_writes_datasets_and_an_overlay_that_names_them(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "pref"
    assert tool.main(["--input", str(_corpus(tmp_path / "c.jsonl")), "--output-dir", str(out), "--format", fmt,
                      "--tokenizer-type", "CharLevelTokenizer", "--prompt-words", "4", "--completion-words", "5",
                      "--valid-fraction", "0.25", "--rejected", "other-document"]) == 0
    overlay = yaml.safe_load((out / ("dpo.yml" if fmt == "pairwise" else "kto.yml")).read_text())
    args = NeoXArgs(**overlay)
    if fmt == "pairwise":
        assert args.train_impl == "dpo" and args.dataset_impl == "pairwise"
        assert len(MMapIndexedDataset(args.pos_train_data_paths[0])) == 15
        assert len(MMapIndexedDataset(args.neg_valid_label_data_paths[0])) == 5
        # held-out pairs take their rejected text from held-out documents only (w0..w4), never from
        # documents the policy trains on
        valid = [json.loads(line) for line in (out / "valid.jsonl").read_text().splitlines()]
        train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
        held_out = {f"w{i}x" for i in range(5)}
        assert all(pair["rejected"].split()[0][:3] in held_out for pair in valid)
        assert not any(pair["rejected"].split()[0][:3] in held_out for pair in train)
    else:
        assert args.train_impl == "kto"
        assert len(MMapIndexedDataset(args.train_reward_data_paths[0])) == 30  # one row per completion
    with pytest.raises(DataError, match="prepare_data.py"):
        tool.main(["--input", str(tmp_path / "missing.jsonl"), "--output-dir", str(out)])
