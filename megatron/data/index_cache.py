"""On-disk cache for index arrays (sample index, blend index, tokenized URL corpora).

Indices are pure functions of their inputs, so they are cached under a file name that is a hash of
those inputs: the *content* of the data (size of the ``.bin`` plus a hash of the ``.idx`` bytes), not
its name, so replacing a corpus in place can never reuse a stale index.

A cache file holds several named arrays in one file (a small JSON header, then the raw arrays, each
64-byte aligned) so that it can be written atomically (tmp + ``os.replace``) and read back as
memory maps without loading the whole index into every rank.

Building is serialised with an exclusive ``flock`` on a sibling ``.lock`` file: the first process
to take the lock (in practice local rank 0, which gets there first) builds and publishes; the others
block on the lock, then find the finished file and only read it. The kernel drops the lock if the
builder dies, so a crashed build never leaves the other ranks waiting forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megatron.atomic_files import atomic_path
from megatron.errors import DataError
from megatron.logging.progress import phase

log = logging.getLogger("deepy.data")  # a child of the run logger: the speaking rank shows it

_MAGIC = b"DEEPYIDX"
_ALIGN = 64
# Bump when the meaning of a cached array changes, so old caches are not reused.
CACHE_VERSION = 1


def file_content_key(path: str | os.PathLike[str]) -> str:
    """A short hash of a file's bytes and size (raises DataError if it is missing)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"missing data file {p}; run `python prepare_data.py` to create it")
    h = hashlib.sha256()
    h.update(str(p.stat().st_size).encode())
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def dataset_content_key(prefix: str) -> str:
    """Content key of an MMIDIDX pair: hash of the ``.idx`` bytes plus the ``.bin`` size.

    The ``.idx`` holds every document length, so together with the ``.bin`` size it pins the
    layout an index is built from; hashing the (large) ``.bin`` itself would cost minutes.
    """
    idx, binf = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, binf):
        if not p.is_file():
            raise DataError(f"missing data file {p}; run `python prepare_data.py` to create it")
    h = hashlib.sha256()
    h.update(file_content_key(idx).encode())
    h.update(str(binf.stat().st_size).encode())
    return h.hexdigest()[:20]


def cache_key(**params: object) -> str:
    """Hash of the parameters an index depends on (order-independent, JSON-stable)."""
    payload = json.dumps({"version": CACHE_VERSION, **params}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def save_arrays(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` atomically: readers see the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []  # the JSON header
    offset = 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset})
        offset += arr.nbytes
    header = json.dumps(entries).encode()
    data_start = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(_MAGIC)
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for entry, arr in zip(entries, arrays.values()):
            f.seek(data_start + entry["offset"])
            f.write(np.ascontiguousarray(arr).tobytes())


def load_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a file written by :func:`save_arrays` as read-only memory maps."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise DataError(f"{path} is not a Deepy index cache file; delete it to rebuild")
        header_len = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(header_len))
    data_start = -(-(len(_MAGIC) + 8 + header_len) // _ALIGN) * _ALIGN
    out: dict[str, np.ndarray] = {}
    for e in entries:
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        if int(np.prod(shape)) == 0:
            out[e["name"]] = np.zeros(shape, dtype=dtype)
            continue
        out[e["name"]] = np.memmap(path, dtype=dtype, mode="r", offset=data_start + e["offset"], shape=shape)
    return out


def build_once(target: str | os.PathLike[str], build: Callable[[], None], timeout_s: float = 3600.0) -> None:
    """Run ``build`` (which must publish ``target`` atomically) unless ``target`` exists.

    Racing processes serialise on ``<target>.lock``; whoever takes it first builds, the others find
    the finished target once the lock is released and do nothing.
    """
    target = Path(target)
    if target.exists():
        return
    lock_path = target.with_name(target.name + ".lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_path.open("a")
    except OSError as err:
        raise DataError(f"cannot write the index cache in {target.parent} ({err.strerror}); "
                        "set cache_dir to a writable directory") from None
    with lock:
        deadline = time.monotonic() + timeout_s
        said_waiting = time.monotonic() + 10.0
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DataError(f"timed out after {timeout_s:.0f}s waiting for another rank to build {target}")
                if time.monotonic() > said_waiting:
                    log.info("waiting for another process to build %s", target.name)
                    said_waiting = deadline
                time.sleep(0.05)
        try:
            # Someone else may have published the target while we waited for the lock.
            if not target.exists():
                with phase(log, f"building {target.name} in {target.parent}"):
                    build()
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def load_or_build(
    path: str | os.PathLike[str],
    build: Callable[[], Mapping[str, np.ndarray]],
    timeout_s: float = 3600.0,
) -> dict[str, np.ndarray]:
    """Return the cached arrays at ``path``, building them exactly once across racing processes."""
    build_once(path, lambda: save_arrays(path, build()), timeout_s)
    return load_arrays(path)


def default_cache_dir(data_prefix: str, cache_dir: str | None) -> Path:
    """``cache_dir`` if set, else an ``index-cache`` folder next to the data."""
    if cache_dir:
        return Path(cache_dir)
    return Path(data_prefix).parent / "index-cache"
