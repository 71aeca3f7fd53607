"""Data in a bucket (megatron/data/remote_data.py), beyond the same-samples checks of tests/unit/test_remote_data.py,
against a real S3-compatible server (moto's server mode, tests/s3_server.py): ranks racing for the same copy
download it once, the server's own request log being the witness; a key that would lead out of the cache stays in
it; a per-split path list keeps one entry per weight; and what cannot be read from a bucket is refused before launch
by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def write_prefix(prefix: Path, documents: int = 12) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for i in range(documents):
        builder.add_item((np.arange(40) * (i + 3)) % 97)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def upload_prefix(s3_server: Any, bucket: str, prefix: Path, key: str) -> None:
    for ext in (".bin", ".idx"):
        s3_server.client().upload_file(str(prefix) + ext, bucket, key + ext)


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from megatron.data.remote_data import local_copy

    url, cache, ready, go = sys.argv[1:5]
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.005)
    print(local_copy(url, cache))
""")


def test_ranks_racing_for_one_copy_download_it_once(s3_server: Any, tmp_path: Path) -> None:
    """Four processes (the ranks of a node) ask for the same prefix at the same moment: one downloads, under the
    cache's lock, into a temporary name renamed into place; the others wait and read its copy. Without the lock
    each would GET the objects (4 GETs of the .bin in the server's log, not 1)."""
    from megatron.data.remote_data import planned_copy

    bucket = s3_server.bucket("deepy-race")
    write_prefix(tmp_path / "local" / "corpus")
    upload_prefix(s3_server, bucket, tmp_path / "local" / "corpus", "data/corpus")
    url, cache = "s3://deepy-race/data/corpus", tmp_path / "cache"
    plan = planned_copy(url, str(cache))
    assert plan.target.parent == cache / "object_store" / "s3" / "deepy-race" / "data"
    stale = plan.target.with_name(f".{plan.target.name}.partial-1")
    (stale / "corpus.bin").mkdir(parents=True)  # what a download that died leaves behind; never read
    log_before = s3_server.log.read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, url, str(cache), str(tmp_path / f"ready{i}"),
                                str(tmp_path / "go")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for i in range(4)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(4)):
        assert time.monotonic() < deadline and all(r.poll() is None for r in racers), racers[0].stderr
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outputs = [r.communicate(timeout=60) for r in racers]
    assert all(r.returncode == 0 for r in racers), [err for _, err in outputs]
    copies = {out.strip() for out, _ in outputs}
    assert len(copies) == 1
    copy = Path(copies.pop())
    assert copy == plan.target / "corpus"
    for ext in (".bin", ".idx"):
        assert Path(str(copy) + ext).read_bytes() == Path(str(tmp_path / "local" / "corpus") + ext).read_bytes()
    time.sleep(0.2)  # the server writes its request log line after answering
    log = s3_server.log.read_text()[len(log_before):]
    assert log.count('"GET /deepy-race/data/corpus.bin ') == 1, log
    assert log.count('"GET /deepy-race/data/corpus.idx ') == 1, log
    assert sorted(p.name for p in plan.target.parent.iterdir()) == [plan.target.name, f"{plan.target.name}.lock"]


def test_keys_that_lead_out_of_the_cache_stay_in_it(tmp_path: Path) -> None:
    from megatron.data.remote_data import cache_location

    inside = cache_location("s3://b/x/../../../../etc/corpus", str(tmp_path))
    assert inside.parent == tmp_path / "object_store" / "s3" and ".." not in inside.parts
    assert cache_location("s3://b/runs/a/corpus", str(tmp_path)) == tmp_path / "object_store/s3/b/runs/a"
    assert cache_location("s3://b/corpus", None) == Path("cache/object_store/s3/b")


def test_a_path_list_keeps_one_entry_per_weight(s3_server: Any, tmp_path: Path) -> None:
    """``train_data_paths`` are taken as written (a brace in a prefix is no pattern there, as in GPT-NeoX); the
    ``train_urls`` patterns expand into their shards, each downloaded."""
    from megatron.data.config import DataArgs
    from megatron.data.remote_data import localized

    bucket = s3_server.bucket("deepy-lists")
    write_prefix(tmp_path / "local" / "c")
    upload_prefix(s3_server, bucket, tmp_path / "local" / "c", "d/c{1,2}")  # braces are legal in a key
    for name in ("s1.jsonl", "s2.jsonl"):
        s3_server.client().put_object(Bucket=bucket, Key=f"u/{name}", Body=b'{"text": "a b c"}\n')
    keys = DataArgs(train_data_paths=["s3://deepy-lists/d/c{1,2}", str(tmp_path / "local" / "c")],
                    train_data_weights=[1.0, 3.0], cache_dir=str(tmp_path / "cache"))
    local = localized(keys)
    assert local.train_data_paths is not None and len(local.train_data_paths) == 2
    assert local.train_data_paths[1] == str(tmp_path / "local" / "c") and local.train_data_weights == [1.0, 3.0]
    assert Path(local.train_data_paths[0] + ".idx").read_bytes() == (tmp_path / "local" / "c.idx").read_bytes()
    urls = localized(DataArgs(train_urls=["s3://deepy-lists/u/s{1,2}.jsonl"], cache_dir=str(tmp_path / "cache")))
    assert [Path(p).name for p in urls.train_urls or []] == ["s1.jsonl", "s2.jsonl"]
    assert all(Path(p).read_bytes() == b'{"text": "a b c"}\n' for p in urls.train_urls or [])


def test_what_a_bucket_cannot_give_is_refused_before_launch(s3_server: Any, local_setup_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing object of a per-split list and of a train_urls pattern, an unknown scheme, and the reference
    log-probs that precompute would write beside a dataset in a bucket: each refused by key and where it was set,
    before anything is launched or downloaded."""
    from megatron.app.deepy import DeepyCommand, resolve
    from megatron.config_rules import Device
    from megatron.errors import DeepyError

    bucket = s3_server.bucket("deepy-checks")
    write_prefix(local_setup_dir / "remote" / "corpus")
    upload_prefix(s3_server, bucket, local_setup_dir / "remote" / "corpus", "d/corpus")
    monkeypatch.chdir(local_setup_dir)

    def refusal(script: str, *overrides: str) -> str:
        with pytest.raises(DeepyError) as err:
            resolve(DeepyCommand(script, ["configs/tiny.yml", "configs/local_setup.yml"], ["data_path=", *overrides]),
                    device=Device(cuda=False, fp16_supported=False))
        return err.value.message

    message = refusal("train.py", "train_data_paths=[s3://deepy-checks/d/corpus,s3://deepy-checks/d/gone]",
                      "valid_data_paths=[s3://deepy-checks/d/corpus]")
    assert "train_data_paths=" in message and "s3://deepy-checks/d/gone: no such object in the store" in message
    assert "valid_data_paths" not in message  # the path that is there passes
    message = refusal("train.py", 'train_urls=["s3://deepy-checks/u/s{1,2}.jsonl"]', "cache_dir=cache")
    assert "s3://deepy-checks/u/s1.jsonl: no such object in the store" in message
    message = refusal("train.py", "train_data_paths=[s3x://deepy-checks/d/corpus]")
    assert "train_data_paths (command line): s3x://deepy-checks/d/corpus: Deepy cannot read or write s3x://" in message
    message = refusal("generate.py", "text_gen_type=precompute", "precompute_model_name=ref",
                      "train_data_paths=[s3://deepy-checks/d/corpus]")
    assert ("text_gen_type='precompute' (command line) writes reference log-probs beside each dataset, and "
            "train_data_paths=") in message and "copy the data to a local path" in message
    message = refusal("train.py", "train_data_paths=[https://example.com/d/corpus]")
    assert ("train_data_paths=['https://example.com/d/corpus'] (command line): https://example.com/d/corpus would be "
            "downloaded; Deepy reads data from local paths and object storage") in message
    message = refusal("train.py", "train_impl=dpo", "reference_logps=ref",
                      "pos_train_data_paths=[s3://deepy-checks/d/corpus]",
                      "neg_train_data_paths=[s3://deepy-checks/d/corpus]")
    assert ("reference_logps='ref' (command line) reads reference log-probs beside each dataset, and "
            "pos_train_data_paths=") in message and "<prefix>_ref.bin/.idx) as a local path" in message
