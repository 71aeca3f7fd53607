"""Object storage for checkpoints (megatron/object_store.py, megatron/checkpointing/remote.py), against a real
S3-compatible server on localhost (moto's server mode, tests/s3_server.py): no boto3 call is mocked.

The runs that save into a bucket, resume from one and mirror GPT-NeoX's ``s3_path`` are in
tests/distributed/test_checkpoint_engine.py (real DeepSpeed engines on gloo ranks); here: the keys, the refusals
before launch, and GPT-NeoX's multipart parts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from megatron import object_store
from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.manager import CheckpointManager
from megatron.checkpointing.preemption import PreemptionWatcher
from megatron.config_rules import Device
from megatron.errors import DeepyError

MIB = 1024 * 1024


def manager(**keys: Any) -> CheckpointManager:
    return CheckpointManager.from_config(CheckpointArgs(**keys), args_record={}, train_iters=10,
                                         preemption=PreemptionWatcher())


def test_paths_with_a_scheme_are_object_stores() -> None:
    assert object_store.scheme_of("s3://bucket/run") == "s3"
    assert object_store.scheme_of("GS://bucket/run") == "gs"
    assert object_store.scheme_of("file:///tmp/run") is None and object_store.local_path("file:///tmp/run") == "/tmp/run"
    assert object_store.scheme_of("/tmp/s3://x") is None and object_store.scheme_of("ckpt") is None
    # GPT-NeoX's os.path.join(s3_path, os.path.basename(save), tag): a save ending in "/" adds nothing
    assert object_store.join("s3://b/p/", "", "global_step2", "x.pt") == "s3://b/p/global_step2/x.pt"


def test_refused_by_name(s3_server: Any) -> None:
    s3_server.bucket("deepy-here")
    object_store.check_url("save", "s3://deepy-here/run", write=True)  # exists: accepted
    with pytest.raises(object_store.StoreError, match=r"save \(a.yml:3\): s3://deepy-nowhere/run: bucket "
                                                      r"'deepy-nowhere' does not exist \(endpoint http://127"):
        object_store.check_url("save", "s3://deepy-nowhere/run", "a.yml:3", write=True)
    with pytest.raises(object_store.StoreError, match=r"cannot read or write s3x:// paths"):
        object_store.check_url("save", "s3x://b/run", write=True)
    with pytest.raises(object_store.StoreError, match=r"https:// is read-only"):
        object_store.check_url("save", "https://example.com/run", write=True)
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(object_store.StoreError, match=r"gs:// paths need a package .*gcsfs"):
            object_store.check_url("save", "gs://b/run", write=True)


def multipart_etag(data: bytes, chunk: int) -> str:
    """S3's ETag of an object uploaded in parts of ``chunk`` bytes: the MD5 of the parts' MD5s, then ``-<parts>``."""
    parts = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    return hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f"-{len(parts)}"


def test_s3_chunk_size_cuts_the_multipart_parts(s3_server: Any, tmp_path: Path) -> None:
    """GPT-NeoX's _upload (gpt-neox@ea7aefd8 megatron/checkpointing.py) uploads every file in multipart parts of
    s3_chunk_size bytes, small files too (one part): each object's ETag is then S3's multipart ETag of those parts,
    recomputed here from the bytes. (Run by hand, GPT-NeoX's own upload_checkpoint gave the same keys, bytes and
    ETags for a Deepy checkpoint: docs/checkpoint_storage.md.)"""
    s3_server.bucket("deepy-parts")
    save = tmp_path / "run"
    (save / "global_step2" / "sub").mkdir(parents=True)
    files = {"global_step2/sub/big.pt": os.urandom(11 * MIB), "global_step2/COMMITTED": b"{}"}
    for name, data in files.items():
        (save / name).write_bytes(data)
    for chunk in (5 * MIB, 104857600):
        mirror = manager(save=str(save), s3_path=f"s3://deepy-parts/c{chunk}", s3_chunk_size=chunk).mirror
        assert mirror is not None and mirror.chunk_size == chunk and not mirror.is_save
        mirror.upload(save, "global_step2")
        assert s3_server.objects("deepy-parts", f"c{chunk}/run/") == files  # <s3_path>/<basename of save>/<tag>/...
        for name, data in files.items():
            head = s3_server.client().head_object(Bucket="deepy-parts", Key=f"c{chunk}/run/{name}")
            assert head["ETag"].strip('"') == multipart_etag(data, chunk), (chunk, name)
    assert multipart_etag(files["global_step2/sub/big.pt"], 5 * MIB).endswith("-3")
    with pytest.raises(ValueError, match="s3_chunk_size"):
        CheckpointArgs(s3_chunk_size=MIB)  # below S3's smallest part: S3 itself would refuse the upload


def test_checkpoint_staging_dir_holds_a_bucket_save(tmp_path: Path) -> None:
    staged = manager(save="s3://deepy-b/runs/a", load="s3://deepy-b/runs/a", checkpoint_staging_dir=str(tmp_path))
    assert staged.save_dir == tmp_path / "s3" / "deepy-b" / "runs" / "a" == staged.load_dir
    assert staged.mirror is not None and staged.mirror.is_save and staged.load_mirror is staged.mirror
    default = manager(save="s3://deepy-b/runs/a")
    assert default.save_dir == object_store.cache_home() / "deepy/staging/s3/deepy-b/runs/a"
    local = manager(save=str(tmp_path / "x"), async_save=True)
    assert local.mirror is None and local.save_dir == tmp_path / "x" and local.async_save


def test_the_dry_run_refuses_a_bucket_it_cannot_use(s3_server: Any, local_setup_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `save=s3://bucket/run` trained into a local directory named `s3:/bucket/run` and nothing reached
    the bucket. Now each such path is probed before launch and refused by name."""
    from megatron.app.deepy import DeepyCommand, resolve

    monkeypatch.chdir(local_setup_dir)
    cpu = Device(cuda=False, fp16_supported=False)
    s3_server.bucket("deepy-present")

    def dry_run(*overrides: str) -> None:
        resolve(DeepyCommand("train.py", ["configs/tiny.yml", "configs/local_setup.yml"], list(overrides)), device=cpu)

    for overrides, says in (
        (["save=s3://deepy-missing/run", "checkpoint_factor=2"], r"save \(command line\): s3://deepy-missing/run: "
                                                                 r"bucket 'deepy-missing' does not exist"),
        (["save=weird://b/run", "checkpoint_factor=2"], r"save \(command line\): weird://b/run: Deepy cannot read"),
        (["load=s3://deepy-missing/run"], r"load \(command line\): s3://deepy-missing/run: bucket"),
        (["save=s3://deepy-present/r", "s3_path=s3://deepy-present/m"], r"`save` is already in object storage"),
        (["initialize_from=s3://deepy-missing/w"], r"initialize_from=.*copy s3://deepy-missing/w to this machine"),
        (["hf_save_path=s3://deepy-missing/hf", "hf_save_interval=2"], r"hf_save_path \(command line\): "
                                                                       r"s3://deepy-missing/hf: bucket"),
        (["log_dir=gs://b/logs"], r"log_dir=.* is read and written as a local path only"),
    ):
        with pytest.raises(DeepyError, match=says):
            dry_run(*overrides)
    assert not (local_setup_dir / "s3:").exists()
    dry_run("save=s3://deepy-present/run", "load=s3://deepy-present/run", "checkpoint_factor=2", "async_save=true",
            "s3_chunk_size=5242880")
    dry_run("s3_path=s3://deepy-present/m", "checkpoint_factor=2")  # GPT-NeoX's copy of the local `save`


def test_other_schemes_go_through_fsspec(tmp_path: Path) -> None:
    """A scheme fsspec implements (its in-memory file system here) takes the same uploads and downloads."""
    tree = tmp_path / "global_step3"
    (tree / "deep").mkdir(parents=True)
    (tree / "deep" / "a.pt").write_bytes(b"weights")
    (tree / "COMMITTED").write_text("{}")
    object_store.check_url("save", "memory://deepy/", write=True, probe=False)
    order = object_store.upload_tree(tree, "memory://deepy/run/global_step3", 5 * MIB, last=["COMMITTED"])
    assert order == ["deep/a.pt", "COMMITTED"]
    store = object_store.store_for("memory://deepy/run")
    assert sorted(e.key for e in store.list("memory://deepy/run")) == ["global_step3/COMMITTED",
                                                                        "global_step3/deep/a.pt"]
    back = tmp_path / "back"
    object_store.download_tree("memory://deepy/run/global_step3", back)
    assert (back / "deep" / "a.pt").read_bytes() == b"weights" and (back / "COMMITTED").read_text() == "{}"
    store.delete("memory://deepy/run/global_step3")
    assert store.list("memory://deepy/run") == []
