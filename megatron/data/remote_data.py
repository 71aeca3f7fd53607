"""Data in object storage (``s3://``, ``gs://``, ... : ``megatron/object_store.py``), read as local files.

A data path in a bucket (GPT-NeoX's ``data_path``/``*_data_paths`` prefix of ``.bin``/``.idx`` files, Levanter's
``train_urls``/``validation_urls`` shards, fms-fsdp's ``data_path`` directory of token shards) is downloaded once
into the data cache (``cache_dir``), under a name made of the URL and the objects' versions (S3's ETags, sizes): the
same objects are never downloaded twice, changed ones are downloaded again beside the old copy. One process per cache downloads
(``index_cache.build_once``'s lock), into a temporary directory renamed into place, so a reader never sees half a
download. Everything after that reads the local copy: the same samples, the same losses as the local files (tested
in tests/unit/test_remote_data.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron import object_store
from megatron.data.config import PATH_KEYS, DataArgs
from megatron.data.index_cache import build_once
from megatron.data.url_sources import expand_braces
from megatron.errors import DataError


DEFAULT_CACHE_DIR = "cache"
"""Without ``cache_dir``: ``cache/object_store/...`` below the working directory, beside the other data caches
(``cache/urls``, ``cache/shards``)."""


def _objects(url: str) -> tuple[str, list[object_store.Entry]]:
    """What ``url`` names: ``"dir"`` (objects below it), ``"prefix"`` (``<url>.bin`` and ``<url>.idx``) or
    ``"file"``, with its objects (paths relative to the URL's parent)."""
    store = object_store.store_for(url)
    name = url.rstrip("/").rsplit("/", 1)[-1]
    below = store.list(url)
    if below:
        odd = next((e.key for e in below if any(p in (".", "..") for p in e.key.split("/"))), None)
        if odd is not None:  # a legal S3 key that would be written outside the copy's directory
            raise DataError(f"{url}: the object {odd!r} below it has a '.' or '..' segment; rename it in the store")
        return "dir", [object_store.Entry(f"{name}/{e.key}", e.size, e.version) for e in below]
    pair = [store.stat(url + ext) for ext in (".bin", ".idx")]
    if all(pair):
        return "prefix", [object_store.Entry(name + ext, e.size, e.version)
                          for ext, e in zip((".bin", ".idx"), pair) if e is not None]
    single = store.stat(url)
    if single is not None:
        return "file", [object_store.Entry(name, single.size, single.version)]
    raise DataError(f"{url}: no such object in the store (nor {name}.bin/{name}.idx, nor objects below it)")


URL_KEYS = ("train_urls", "validation_urls")
"""Levanter's raw-text sources: brace patterns (``shard-{001..128}.jsonl``), expanded as ``url_sources`` expands
local ones. The dataset prefixes of ``data_path``/``*_data_paths`` are taken as written (GPT-NeoX expands nothing,
and one path is one weight)."""


def describe_objects(url: str, *, patterns: bool = False) -> str:
    """What ``url`` (a brace pattern when ``patterns``) names in its store, in words; :class:`DataError` when nothing
    is there."""
    found = []
    for each in expand_braces(url) if patterns else [url]:
        kind, entries = _objects(each)
        found.append(f"{kind} of {len(entries)} object(s), {sum(e.size for e in entries)} bytes")
    return "; ".join(found)


def cache_location(url: str, cache_dir: str | None) -> Path:
    """``<cache_dir>/object_store/<scheme>/<bucket>/<the URL's parent>``: where the versions of ``url``'s copy live
    (``object_store.local_dir_for``: a key with ``.``/``..`` segments is hashed, never a way out of the cache)."""
    scheme, _, rest = url.partition("://")
    parent = rest.rstrip("/").rsplit("/", 1)[0] if "/" in rest.strip("/") else rest
    return object_store.local_dir_for(f"{scheme}://{parent}",
                                      Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / "object_store")


@dataclass(frozen=True)
class PlannedCopy:
    """Where the local copy of one URL goes, and what it is made of."""

    target: Path
    """``<cache_location>/<version>``: a hash of the URL and its objects' keys, sizes and versions (ETags)."""
    name: str
    """The URL's last segment: ``target / name`` is the local path (a file, a dataset prefix, a directory)."""
    entries: list[object_store.Entry]
    """Its objects, keys relative to the URL's parent."""


def planned_copy(url: str, cache_dir: str | None) -> PlannedCopy:
    """The copy of ``url`` in the cache (one listing, or a ``HEAD`` per object; nothing is downloaded)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    if name in (".", ".."):
        raise DataError(f"{url}: a data path in object storage ends in a name, not {name!r}")
    _, entries = _objects(url)
    version = hashlib.sha256(repr((url, sorted((e.key, e.size, e.version) for e in entries))).encode()).hexdigest()[:16]
    return PlannedCopy(cache_location(url, cache_dir) / version, name, entries)


def local_copy(url: str, cache_dir: str | None) -> str:
    """The local path that stands for ``url`` (a file, a dataset prefix or a directory), downloaded if needed."""
    if not object_store.is_remote(url):
        return url
    plan = planned_copy(url, cache_dir)
    target = plan.target

    def download() -> None:
        for stale in target.parent.glob(f".{target.name}.partial-*"):  # a download that died; the lock is ours
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
        store = object_store.store_for(url)
        base = url.rstrip("/").rsplit("/", 1)[0]
        for entry in plan.entries:
            store.get_file(object_store.join(base, entry.key), tmp / entry.key)
        os.replace(tmp, target)

    build_once(target, download)
    return str(target / plan.name)


def local_copies(urls: list[str], cache_dir: str | None) -> list[str]:
    return [local_copy(url, cache_dir) for url in urls]


def localized(keys: DataArgs) -> DataArgs:
    """``keys`` with every data path in object storage replaced by its local copy (downloaded here if needed)."""
    cache = keys.cache_dir
    update: dict[str, object] = {}
    data_path = keys.data_path
    if isinstance(data_path, str) and object_store.is_remote(data_path):
        update["data_path"] = local_copy(data_path, cache)
    elif isinstance(data_path, list) and any(object_store.is_remote(p) for p in data_path):
        update["data_path"] = local_copies(list(data_path), cache)
    for key in (*PATH_KEYS, *URL_KEYS):
        paths = getattr(keys, key)
        if paths and any(object_store.is_remote(str(p)) for p in paths):
            if key in URL_KEYS:  # each remote pattern's shards, downloaded one by one (a local pattern stays whole)
                paths = [q for p in paths for q in (expand_braces(str(p)) if object_store.is_remote(str(p)) else [p])]
            update[key] = local_copies([str(p) for p in paths], cache)
    return keys.model_copy(update=update) if update else keys
