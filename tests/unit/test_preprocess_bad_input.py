"""Bad input to preprocess_data.py: one clear message with file:line, exit code 2, no traceback, no output."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "datasets" / "preprocess_data.py"

GOOD = [json.dumps({"text": f"document number {i} has some words in it."}).encode() + b"\n" for i in range(6)]


def run(tmp_path: Path, lines: list[bytes] | bytes, *extra: str, name: str = "in.jsonl",
        workers: int = 1) -> subprocess.CompletedProcess[str]:
    path = tmp_path / name
    path.write_bytes(lines if isinstance(lines, bytes) else b"".join(lines))
    cmd = [sys.executable, str(TOOL), "--input", str(path), "--output-prefix", str(tmp_path / "out"),
           "--tokenizer-type", "CharLevelTokenizer", "--append-eod", "--quiet", "--workers", str(workers), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def assert_user_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("deepy: data error: ")
    for fragment in fragments:
        assert fragment in r.stderr, r.stderr


def assert_no_output(tmp_path: Path) -> None:
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))
    assert left == [], left  # neither a dataset nor temporary files


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_json_names_file_and_line(tmp_path: Path, workers: int) -> None:
    r = run(tmp_path, [*GOOD[:3], b'{"text": "unterminated\n', *GOOD[3:]], workers=workers)
    assert_user_error(r, "in.jsonl:4", "malformed JSON", "--skip-bad")
    assert_no_output(tmp_path)


def test_malformed_json_skipped_with_skip_bad(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], b"not json at all\n", GOOD[1], b"[1, 2]\n", GOOD[2]], "--skip-bad")
    assert r.returncode == 0, r.stderr
    assert "skipped 2 bad lines" in r.stdout and "in.jsonl:2" in r.stdout and "in.jsonl:4" in r.stdout
    ds = MMapIndexedDataset(tmp_path / "out_text_document")
    assert len(ds) == 3
    assert bytes(ds[1][:-1].tolist()) == json.loads(GOOD[1])["text"].encode()


def test_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], json.dumps({"body": "x"}).encode() + b"\n"])
    assert_user_error(r, "in.jsonl:2", "missing key 'text'", "body", "--jsonl-keys")
    assert_no_output(tmp_path)


def test_missing_key_and_non_string_lines_skipped_with_skip_bad(tmp_path: Path) -> None:
    lines = [GOOD[0], json.dumps({"body": "x"}).encode() + b"\n", b'{"text": 42}\n', GOOD[1]]
    r = run(tmp_path, lines, "--skip-bad")
    assert r.returncode == 0, r.stderr
    assert "skipped 2 bad lines" in r.stdout and "missing key 'text'" in r.stdout and "in.jsonl:3" in r.stdout
    # every line lacking the key: still an error, which names the key
    r = run(tmp_path, [json.dumps({"body": "x"}).encode() + b"\n"] * 2, "--skip-bad")
    assert_user_error(r, "no documents", "missing key 'text'")


def test_non_string_value(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], b'{"text": 42}\n'])
    assert_user_error(r, "in.jsonl:2", "int", "expected a string")


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], GOOD[1], b'{"text": "caf\xe9"}\n'])
    assert_user_error(r, "in.jsonl:3", "invalid UTF-8")
    assert_no_output(tmp_path)


def test_invalid_utf8_skipped_with_skip_bad(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], b'{"text": "caf\xe9"}\n', b'{"text": "lone \\ud800 surrogate"}\n', GOOD[1]],
            "--skip-bad")
    assert r.returncode == 0, r.stderr
    assert "skipped 2 bad lines" in r.stdout and "lone surrogate" in r.stdout
    assert len(MMapIndexedDataset(tmp_path / "out_text_document")) == 2


def test_lone_surrogate_escape_is_invalid_utf8(tmp_path: Path) -> None:
    r = run(tmp_path, [GOOD[0], b'{"text": "bad \\udc80 text"}\n'])
    assert_user_error(r, "in.jsonl:2", "invalid UTF-8")


def test_empty_documents_counted_and_skipped(tmp_path: Path) -> None:
    lines = [GOOD[0], b'{"text": ""}\n', b'{"text": "  \\n\\t "}\n', b"\n", GOOD[1]]
    r = run(tmp_path, lines)
    assert r.returncode == 0, r.stderr
    assert "skipped 2 empty or whitespace-only documents" in r.stdout
    ds = MMapIndexedDataset(tmp_path / "out_text_document")
    assert len(ds) == 2 and list(ds.doc_idx) == [0, 1, 2]


@pytest.mark.parametrize("content", [b"", b"\n\n", b'{"text": ""}\n{"text": "   "}\n'])
def test_input_without_documents_is_an_error(tmp_path: Path, content: bytes) -> None:
    r = run(tmp_path, content)
    assert_user_error(r, "in.jsonl", "no documents", "refusing to write an empty dataset")
    assert_no_output(tmp_path)


def test_only_bad_lines_with_skip_bad_is_an_error(tmp_path: Path) -> None:
    r = run(tmp_path, [b"oops\n", b"{broken\n"], "--skip-bad")
    assert_user_error(r, "no documents", "2 bad lines")
    assert_no_output(tmp_path)


def test_missing_input_and_unmatched_glob(tmp_path: Path) -> None:
    cmd = [sys.executable, str(TOOL), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
           "CharLevelTokenizer", "--quiet", "--input"]
    r = subprocess.run([*cmd, str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120)
    assert_user_error(r, "nope.jsonl", "not found")
    r = subprocess.run([*cmd, str(tmp_path / "*.jsonl")], capture_output=True, text=True, timeout=120)
    assert_user_error(r, "*.jsonl", "no input file matches")


def test_corrupt_gzip(tmp_path: Path) -> None:
    data = gzip.compress(b"".join(GOOD * 50))
    r = run(tmp_path, data[: len(data) // 2], name="in.jsonl.gz")
    assert_user_error(r, "in.jsonl.gz", "cannot read input")
    assert_no_output(tmp_path)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    r = run(tmp_path, GOOD, "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tmp_path / "tok.json"))
    assert_user_error(r, "tok.json", "not found")


def test_debug_shows_traceback(tmp_path: Path) -> None:
    r = run(tmp_path, [b"not json\n"], "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr and "in.jsonl:1" in r.stderr
