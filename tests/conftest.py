"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# The tools a test starts (``python tools/ckpts/convert_neox_to_hf.py ...``) find megatron and tools
# through the installed project; this checkout goes first, so they run the code under test even where
# the editable install points at another clone.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One S3-compatible server (moto's server mode, tests/s3_server.py) per test worker; each test makes its
    own bucket. Its environment variables are set in this process too, so the ranks a test starts inherit them."""
    from s3_server import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    saved = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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
    # each split the shipped configs read holds a sample of their longest seq_length (4096) + 1: the pre-launch
    # checks refuse a split that does not (split 980,15,5 gives validation the last of the 50 documents)
    for i in range(50):
        builder.add_item((np.arange(4200) + i) % 30)
        builder.end_document()
    builder.finalize(str(data / "pydocs_text_document.idx"))
    (root / "configs").symlink_to(REPO / "configs")
    return root



@pytest.fixture()
def key_not_supported_yet(monkeypatch: pytest.MonkeyPatch) -> str:
    """A GPT-NeoX key marked *not supported yet* (``config_schema.not_supported``) for one test: issue 47 built or
    refused every real one, so the tests of how such a key is refused mark one (``use_mup``) while they run."""
    from megatron.config_schema import SUPPORTED_KEY
    from megatron.neox_arguments.arguments import NeoXArgs

    key = "use_mup"
    monkeypatch.setattr(NeoXArgs.model_fields[key], "json_schema_extra", {SUPPORTED_KEY: False})
    return key


@pytest.fixture(autouse=True)
def _forget_deepspeeds_model_parallel_view() -> Iterator[None]:
    """DeepSpeed keeps the ``mpu`` of the last ``deepspeed.initialize(mpu=...)`` in a module global
    (``deepspeed.utils.groups.mpu``) and asks it for groups in every later engine of the process; once a test
    has torn down Deepy's groups, the next in-process engine of the same pytest worker got a group of None."""
    yield
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups.mpu = None
