"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def local_setup_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding what configs/local_setup.yml names: a small tokenized corpus and
    its tokenizer (the pre-launch checks open both), and the shipped configs."""
    import numpy as np
    import tokenizers

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    root = tmp_path_factory.mktemp("local_setup")
    data = root / "data" / "pydocs"
    data.mkdir(parents=True)
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(data / "tokenizer.json"))
    builder = MMapIndexedDatasetBuilder(str(data / "pydocs_text_document.bin"), np.uint16)
    for i in range(50):
        builder.add_item(np.arange(8) + i % 20)
        builder.end_document()
    builder.finalize(str(data / "pydocs_text_document.idx"))
    (root / "configs").symlink_to(REPO / "configs")
    return root


# --- how the suite is spread over pytest-xdist's workers (pytest.ini: -n 2 --dist loadgroup) ----
# Each test file is one group, so a module-scoped fixture (a training run many tests read) runs once,
# on one worker. Files that share a session fixture form one group, so it runs once as well.
SHARED_SESSION_FIXTURES = {
    # conftest.py's two_runs_at_once: the uninterrupted reference curve of every launcher test
    "tests/e2e/test_launch_lifecycle.py": "launch_reference",
    "tests/e2e/test_slurm.py": "launch_reference",
    "tests/e2e/test_mpi.py": "launch_reference",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(SHARED_SESSION_FIXTURES.get(path, path)))
