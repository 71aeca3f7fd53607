"""prepare_data.py: the embedded pydocs corpus is built, usable and byte-for-byte reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tokenizers

from megatron.data.indexed_dataset import MMapIndexedDataset

REPO = Path(__file__).resolve().parents[2]
FILES = ("pydocs.jsonl", "tokenizer.json", "pydocs_text_document.bin", "pydocs_text_document.idx")


def prepare(data_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO / "prepare_data.py"), "-d", str(data_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=data_dir.parent)


def test_pydocs_is_deterministic_and_consistent(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        r = prepare(d, "--max-docs", "120", "--vocab-size", "400")
        assert r.returncode == 0, r.stderr
    for name in FILES:
        assert (a / "pydocs" / name).read_bytes() == (b / "pydocs" / name).read_bytes(), name

    docs = [json.loads(line)["text"] for line in (a / "pydocs" / "pydocs.jsonl").read_text().splitlines()]
    assert len(docs) == 120 and all(d.strip() for d in docs)
    # Text that ships with Python: the language reference topics come first.
    assert any("assert" in d for d in docs[:20])

    hf = tokenizers.Tokenizer.from_file(str(a / "pydocs" / "tokenizer.json"))
    assert hf.get_vocab_size() == 400
    eod = hf.token_to_id("<|endoftext|>")
    ds = MMapIndexedDataset(a / "pydocs" / "pydocs_text_document")
    assert len(ds) == 120 and len(ds.doc_idx) == 121
    for i in (0, 57, 119):
        assert ds[i].tolist() == hf.encode(docs[i]).ids + [eod]


def test_default_corpus_is_large_enough() -> None:
    # In a subprocess: collecting imports hundreds of stdlib modules, which this test process should not.
    code = ("import json, prepare_data as p; t = p.pydoc_topics(); d = p.stdlib_docstrings(); "
            "print(json.dumps([len(t), len(d), len(set(d)), sum(map(len, t + d))]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    topics, docs, distinct, chars = json.loads(r.stdout)
    assert topics > 50 and docs > 1000 and distinct == docs
    assert chars > 1_000_000  # a corpus a tiny model can learn from


def test_unknown_dataset_is_a_usage_error(tmp_path: Path) -> None:
    r = prepare(tmp_path / "d", "enwik8")
    assert r.returncode == 2 and "unknown dataset 'enwik8'" in r.stderr and "Traceback" not in r.stderr
