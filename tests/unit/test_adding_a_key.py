"""Adding a key to a component touches three files: the group that declares it, the code that reads it and a test
(issue 46). The docs regenerate (``python -m megatron.neox_arguments.docs``); nothing else is edited.

Shown on a copy of the repository, as a user adds the toy norm in a file of their own
(``tests/fixtures/toy_norm.py``): the copy gains ``log_first_step`` (a logging key: also log the first step)
in ``megatron/logging/config.py``, the monitor reads it (``megatron/logging/monitor.py``) and a new test
observes it. The copy's guards on keys then pass unchanged: the schema and its derived extras, the honesty
test (read by a component and shown by a test), the resolved-config snapshot, the docs' freshness, the
loader, the overrides and did-you-mean, the "declared once" and "not restated" checks. Without the test
that shows the key's effect the honesty test fails, so the check can fail.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

GUARDS = [
    "tests/unit/test_schema.py", "tests/unit/test_config_honesty.py", "tests/unit/test_resolved_unchanged.py",
    "tests/unit/test_docs_fresh.py", "tests/unit/test_config_loading.py", "tests/unit/test_overrides.py",
    "tests/unit/test_keys_declared_once.py", "tests/unit/test_no_key_restatements.py",
    "tests/unit/test_config_any_value.py",
]
"""The tests that hold every key to a rule (each reads the whole schema)."""

GROUP_FILE, READER_FILE, TEST_FILE = ("megatron/logging/config.py", "megatron/logging/monitor.py",
                                      "tests/unit/test_log_first_step.py")
DOCS = "configs/neox_arguments.md"

DECLARATION = '''
    log_first_step: bool = False
    """Also log the first step of each launch, whatever log_interval says (a toy key of issue 46's test)."""
'''

READ_BEFORE = "        return iteration % self.config.log_interval == 0 or iteration == self.train_iters\n"
READ_AFTER = ("        return (iteration % self.config.log_interval == 0 or iteration == self.train_iters\n"
              "                or (self.config.log_first_step and iteration == 1))\n")

EFFECT_TEST = '''
from types import SimpleNamespace

from megatron.logging.config import LoggingArgs
from megatron.logging.monitor import Monitor


def test_log_first_step_logs_step_one() -> None:
    off = SimpleNamespace(config=LoggingArgs(log_interval=10), train_iters=100)
    on = SimpleNamespace(config=LoggingArgs(log_interval=10, log_first_step=True), train_iters=100)
    assert not Monitor.is_log_step(off, 1)  # type: ignore[arg-type]
    assert Monitor.is_log_step(on, 1) and not Monitor.is_log_step(on, 2)  # type: ignore[arg-type]
'''


def _tracked(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}


def _pytest(copy: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-o", "addopts=", *paths], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's tracked files as they are in this checkout (but this one), in a directory of their own."""
    root = tmp_path_factory.mktemp("added_key") / "repo"
    this = Path(__file__).relative_to(REPO).as_posix()  # its text names the toy key: it would count as the effect test
    for rel in (rel for rel in _tracked(REPO) if rel != this):
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((REPO / rel).read_bytes())
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)  # the guards list the repository's files
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def test_a_key_takes_its_group_its_reader_and_a_test(copy: Path) -> None:
    before = _digests(copy)
    group = copy / GROUP_FILE
    text = group.read_text()
    anchor = '    log_interval: int = Field(100, ge=1)\n'
    assert anchor in text
    doc_end = text.index('"""', text.index('"""', text.index(anchor) + len(anchor)) + 3) + 4
    group.write_text(text[:doc_end] + DECLARATION + text[doc_end:])
    reader = copy / READER_FILE
    assert READ_BEFORE in reader.read_text()
    reader.write_text(reader.read_text().replace(READ_BEFORE, READ_AFTER))
    # the guards, before the effect test exists: the honesty check names the key
    docs = subprocess.run([sys.executable, "-m", "megatron.neox_arguments.docs"], cwd=copy, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(copy)}, check=True).stdout
    (copy / DOCS).write_text(docs)
    subprocess.run(["git", "add", "-A"], cwd=copy, check=True)
    without = _pytest(copy, "tests/unit/test_config_honesty.py")
    assert without.returncode != 0 and "log_first_step" in without.stdout, without.stdout[-3000:]

    (copy / TEST_FILE).write_text(EFFECT_TEST)
    subprocess.run(["git", "add", "-A"], cwd=copy, check=True)
    result = _pytest(copy, TEST_FILE, *GUARDS)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "log_first_step" in (copy / DOCS).read_text()

    after = _digests(copy)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p) and not p.startswith(".git/"))
    assert changed == sorted([GROUP_FILE, READER_FILE, TEST_FILE, DOCS])
