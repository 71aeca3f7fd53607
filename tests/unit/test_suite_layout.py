"""The suite collects as one run: `python -m pytest -q` (the README's test command) imports every test
file by its basename (rootdir-relative, no packages), so two files of one name in different folders
stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_names_are_unique_across_folders() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
