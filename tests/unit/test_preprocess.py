"""preprocess_data.py end to end: exact output bytes, input formats, parallel modes, int32, merge/count tools."""

from __future__ import annotations

import gzip
import inspect
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from megatron.data.indexed_dataset import MMapIndexedDataset
from tools.datasets import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "datasets"


def corpus_texts() -> list[str]:
    """Real text (docstrings of a few stdlib modules) with unicode and a special string inside."""
    import collections
    import json as json_mod
    import re
    import string
    import textwrap

    texts = []
    for mod in (collections, json_mod, re, string, textwrap):
        for name, obj in sorted(vars(mod).items()):
            if not name.startswith("_") and (doc := inspect.getdoc(obj)) and len(doc) > 40:
                texts.append(doc)
    texts += ["Grüße aus Köln — 東京 🙂\n\ttab", "one<|endoftext|>two", "  spaces  around  "]
    return texts


def run(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, timeout=300)


def preprocess(*extra: str) -> subprocess.CompletedProcess[str]:
    return run(str(TOOLS / "preprocess_data.py"), "--quiet", *extra)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus_texts()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    d = tmp_path_factory.mktemp("pre")
    with open(d / "docs.jsonl", "w", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"text": t, "title": f"doc {i}", "id": i}, ensure_ascii=False) + "\n")
    train_tokenizer.save(train_tokenizer.train_bpe(texts, vocab_size=500), d / "tok.json")
    return d


def expected_bytes(docs_ids: list[list[int]], code: int, fmt: str) -> tuple[bytes, bytes]:
    """MMIDIDX bytes built independently: struct for the header and arrays, one sequence per doc."""
    item = struct.calcsize(fmt)
    binary = b"".join(struct.pack(f"<{len(ids)}{fmt}", *ids) for ids in docs_ids)
    sizes = [len(ids) for ids in docs_ids]
    pointers = [sum(sizes[:i]) * item for i in range(len(sizes))]
    doc_idx = list(range(len(sizes) + 1))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sizes), len(doc_idx))
    idx += struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return binary, idx


def hf_ids(tok_path: Path, texts: list[str], eod: bool) -> list[list[int]]:
    hf = tokenizers.Tokenizer.from_file(str(tok_path))
    end = [hf.token_to_id("<|endoftext|>")] if eod else []
    return [hf.encode(t).ids + end for t in texts]


def read(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.mark.parametrize("workers,mode", [(1, "processes"), (2, "processes"), (2, "threads")])
def test_output_bytes_equal_independent_reconstruction(data: Path, texts: list[str], tmp_path: Path,
                                                       workers: int, mode: str) -> None:
    r = preprocess("--input", str(data / "docs.jsonl"), "--output-prefix", str(tmp_path / "out"),
                   "--tokenizer-type", "HFTokenizer", "--vocab-file", str(data / "tok.json"), "--append-eod",
                   "--workers", str(workers), "--parallelism", mode)
    assert r.returncode == 0, r.stderr
    assert "tiktoken backend" in r.stdout and f"{len(texts)} documents" in r.stdout
    assert read(tmp_path / "out_text_document") == expected_bytes(hf_ids(data / "tok.json", texts, True), 8, "H")


def test_without_eod_and_multiple_keys(data: Path, texts: list[str], tmp_path: Path) -> None:
    r = preprocess("--input", str(data / "docs.jsonl"), "--output-prefix", str(tmp_path / "out"),
                   "--tokenizer-type", "HFTokenizer", "--vocab-file", str(data / "tok.json"),
                   "--jsonl-keys", "text", "title")
    assert r.returncode == 0, r.stderr
    tok = data / "tok.json"
    assert read(tmp_path / "out_text_document") == expected_bytes(hf_ids(tok, texts, False), 8, "H")
    titles = [f"doc {i}" for i in range(len(texts))]
    assert read(tmp_path / "out_title_document") == expected_bytes(hf_ids(tok, titles, False), 8, "H")


def test_compressed_globbed_and_listed_inputs(data: Path, texts: list[str], tmp_path: Path) -> None:
    import zstandard

    lines = (data / "docs.jsonl").read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(lines[:third]))
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wb") as fh:
        fh.write(b"".join(lines[third:2 * third]))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[2 * third:])))
    spec = f"{tmp_path / 'in' / '*.jsonl*'},{tmp_path / 'c.jsonl.zst'}"
    r = preprocess("--input", spec, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "HFTokenizer",
                   "--vocab-file", str(data / "tok.json"), "--append-eod", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert read(tmp_path / "out_text_document") == expected_bytes(hf_ids(data / "tok.json", texts, True), 8, "H")


def test_ftfy_repairs_mojibake(data: Path, tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text(json.dumps({"text": "schÃ¶n und grÃ¼n"}) + "\n")
    common = ["--input", str(tmp_path / "m.jsonl"), "--tokenizer-type", "HFTokenizer",
              "--vocab-file", str(data / "tok.json")]
    assert preprocess(*common, "--output-prefix", str(tmp_path / "fixed"), "--ftfy").returncode == 0
    assert preprocess(*common, "--output-prefix", str(tmp_path / "raw")).returncode == 0
    fixed = MMapIndexedDataset(tmp_path / "fixed_text_document")[0].tolist()
    raw = MMapIndexedDataset(tmp_path / "raw_text_document")[0].tolist()
    assert fixed == hf_ids(data / "tok.json", ["schön und grün"], False)[0]
    assert raw != fixed


def test_big_vocab_switches_to_int32(tmp_path: Path) -> None:
    # A word-level vocabulary of 70,000 entries: ids above 65,535 must survive.
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(69_998)}}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "big.json"))
    docs = ["w1 w65535 w69997", "w70000 w12"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    r = preprocess("--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "out"),
                   "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tmp_path / "big.json"), "--append-eod")
    assert r.returncode == 0, r.stderr
    assert "int32 tokens" in r.stdout and "hf backend" in r.stdout
    ids = [[3, 65537, 69999, 0], [1, 14, 0]]
    assert read(tmp_path / "out_text_document") == expected_bytes(ids, 4, "i")


def test_char_level_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hé"}) + "\n" + json.dumps({"text": "ok"}) + "\n")
    r = preprocess("--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "out"),
                   "--tokenizer-type", "CharLevelTokenizer", "--append-eod")
    assert r.returncode == 0, r.stderr
    assert read(tmp_path / "out_text_document") == expected_bytes([[104, 195, 169, 0], [111, 107, 0]], 8, "H")


def test_merge_and_count_tools(data: Path, texts: list[str], tmp_path: Path) -> None:
    common = ["--tokenizer-type", "HFTokenizer", "--vocab-file", str(data / "tok.json"), "--append-eod"]
    half = len(texts) // 2
    lines = (data / "docs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:half]), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(lines[half:]), encoding="utf-8")
    for name in ("a", "b"):
        r = preprocess("--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name), *common)
        assert r.returncode == 0, r.stderr
    r = run(str(TOOLS / "merge_datasets.py"), "--input", str(tmp_path / "a_text_document"),
            str(tmp_path / "b_text_document"), "--output-prefix", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    assert read(tmp_path / "merged") == expected_bytes(hf_ids(data / "tok.json", texts, True), 8, "H")

    r = run(str(TOOLS / "dataset_token_count.py"), "--json", str(tmp_path / "a_text_document"),
            str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    n_tokens = sum(map(len, hf_ids(data / "tok.json", texts, True)))
    assert rows[1]["documents"] == len(texts) and rows[1]["tokens"] == n_tokens
    assert rows[0]["documents"] == half
    assert rows[2]["prefix"] == "total" and rows[2]["documents"] == half + len(texts)

    r = run(str(TOOLS / "merge_datasets.py"), "--input", str(tmp_path / "missing"), "--output-prefix",
            str(tmp_path / "m2"))
    assert r.returncode == 2 and "missing.idx" in r.stderr and "Traceback" not in r.stderr


def test_pack_inserts_eod_after_each_document() -> None:
    from tools.datasets.preprocess_data import pack

    flat, sizes = pack([[5, 6], [], [7]], eod=0, dtype=np.uint16)
    assert flat.tolist() == [5, 6, 0, 0, 7, 0] and sizes.tolist() == [3, 1, 2]
    flat, sizes = pack([[5, 6], [7]], eod=None, dtype=np.int32)
    assert flat.tolist() == [5, 6, 7] and sizes.tolist() == [2, 1] and flat.dtype == np.int32
