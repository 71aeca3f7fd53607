"""Object storage (``s3://``, ``gs://`` and whatever else fsspec knows) as a place for checkpoints and data.

A path with a ``scheme://`` prefix names an object store. Deepy never writes such a path as a local
directory (``Path("s3://b/run")`` is the directory ``s3:/b/run`` under the working directory): every key
that takes one asks :func:`check_url` before launch, which refuses a scheme nothing here can write or read,
a bucket that does not exist and a store that cannot be reached, by name.

* ``s3://`` goes through boto3, as GPT-NeoX's ``megatron/checkpointing.py`` does (EleutherAI/gpt-neox
  @ea7aefd8, ``_upload``: multipart uploads in parts of ``s3_chunk_size``, ``ACL=bucket-owner-full-control``).
  Where it connects and with which credentials come from boto3's standard places only: ``AWS_ENDPOINT_URL``
  (``AWS_ENDPOINT_URL_S3``) for an S3-compatible server, ``AWS_ACCESS_KEY_ID``/``AWS_PROFILE``,
  ``~/.aws/config`` and ``~/.aws/credentials``, the instance's metadata service. Never a config file of ours.
* any other scheme goes through the fsspec implementation registered for it (``gs://`` is gcsfs, ``az://``
  adlfs, ...), with that package's own credential lookup; a scheme whose package is not installed is refused
  before launch, naming the package.

No torch here: ``deepy.py`` probes stores before launching.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron.errors import ConfigError

S3_MIN_PART = 5 * 1024 * 1024
"""S3's smallest multipart part (all but the last): a smaller ``s3_chunk_size`` is refused by S3 itself."""

READ_ONLY_SCHEMES = frozenset({"http", "https", "hf"})
"""Schemes fsspec reads but nothing can write a checkpoint to."""


class StoreError(ConfigError):
    """An object store that cannot be used: unknown scheme, missing package, bucket or credentials."""


def scheme_of(path: str | os.PathLike[str] | None) -> str | None:
    """``"s3"`` for ``s3://bucket/key``; None for a local path (``file://`` is local too)."""
    if path is None:
        return None
    text = str(path)
    head, sep, _ = text.partition("://")
    if not sep or not head or "/" in head:
        return None
    scheme = head.lower()
    return None if scheme == "file" else scheme


def is_remote(path: str | os.PathLike[str] | None) -> bool:
    return scheme_of(path) is not None


def cache_home() -> Path:
    """``$XDG_CACHE_HOME`` (the XDG base directory, which a user or a test points elsewhere), else ``~/.cache``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()


def local_dir_for(url: str, root: Path) -> Path:
    """``<root>/<scheme>/<bucket>/<key parts>``: the local directory that stands for ``url`` (a bucket ``save``'s
    staging, a data copy's place), one per URL. A key with ``.``/``..`` segments (legal in S3, a way out of
    ``root`` as a path) is replaced by its hash."""
    scheme, _, rest = url.partition("://")
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        parts = [hashlib.sha256(rest.encode()).hexdigest()[:16]]
    return root.joinpath(scheme, *parts)


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; any other local path unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def join(url: str, *parts: str) -> str:
    """``join("s3://b/run", "global_step2", "x.pt")``; empty parts are skipped (``os.path.join`` behaves
    so for GPT-NeoX's ``basename(save)`` of a path that ends in ``/``)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://" + posixpath.join(rest.rstrip("/"), *[p.strip("/") for p in parts if p.strip("/")])


@dataclass(frozen=True)
class Entry:
    key: str
    """Path below the listed prefix, with ``/`` separators."""
    size: int
    version: str = ""
    """What changes when the object does (S3's ETag; fsspec's ETag, checksum or modification time)."""


class Store(Protocol):
    """What the checkpoints and the data need of an object store."""

    def probe(self, url: str, write: bool) -> None: ...

    def put_file(self, local: Path, url: str, chunk_size: int) -> None: ...

    def get_file(self, url: str, local: Path) -> None: ...

    def list(self, url: str) -> list[Entry]: ...

    def exists(self, url: str) -> bool: ...

    def stat(self, url: str) -> Entry | None: ...

    def read_text(self, url: str) -> str | None: ...

    def write_text(self, url: str, text: str) -> None: ...

    def delete(self, url: str) -> None: ...


def _bucket_key(url: str) -> tuple[str, str]:
    rest = url.partition("://")[2]
    bucket, _, key = rest.partition("/")
    return bucket, key


class S3Store:
    """``s3://`` through boto3 (the client of GPT-NeoX's uploads)."""

    def __init__(self) -> None:
        try:
            # lazy: boto3 is needed only for s3:// paths
            import boto3
            from botocore.config import Config
        except ImportError as err:  # pragma: no cover - boto3 is a requirement
            raise StoreError(f"s3:// paths need boto3 ({err}); pip install boto3") from err
        self._client: Any = boto3.client(
            "s3", config=Config(connect_timeout=10, read_timeout=120, retries={"max_attempts": 5, "mode": "standard"})
        )

    def probe(self, url: str, write: bool) -> None:
        """The bucket exists and these credentials may use it; one request (``HeadBucket``)."""
        # lazy: boto3 is needed only for s3:// paths
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        bucket, _ = _bucket_key(url)
        if not bucket:
            raise StoreError(f"{url} names no bucket (s3://BUCKET/prefix)")
        try:
            self._client.head_bucket(Bucket=bucket)
        except NoCredentialsError as err:
            raise StoreError(
                f"{url}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                "~/.aws/credentials or the instance's role); Deepy never reads them from a config file"
            ) from err
        except ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreError(f"{url}: bucket {bucket!r} does not exist{_endpoint_note()}") from err
            if code in ("403", "AccessDenied", "Forbidden"):
                raise StoreError(f"{url}: access to bucket {bucket!r} is denied for these credentials") from err
            raise StoreError(f"{url}: {err}") from err
        except BotoCoreError as err:
            raise StoreError(f"{url}: the object store cannot be reached ({err}){_endpoint_note()}") from err

    def put_file(self, local: Path, url: str, chunk_size: int) -> None:
        # lazy: boto3 is needed only for s3:// paths
        from boto3.s3.transfer import TransferConfig

        bucket, key = _bucket_key(url)
        # a multipart upload of every file, in parts of exactly chunk_size, as GPT-NeoX's _upload does (so the
        # objects' ETags are the ones its uploads get: <md5 of the parts' md5s>-<parts>); boto3 sends the parts in
        # parallel (GPT-NeoX: hf_transfer). An empty file, which has no part, goes in one request.
        transfer = TransferConfig(multipart_threshold=1, multipart_chunksize=chunk_size)
        self._client.upload_file(str(local), bucket, key, Config=transfer,
                                 ExtraArgs={"ACL": "bucket-owner-full-control"})

    def get_file(self, url: str, local: Path) -> None:
        bucket, key = _bucket_key(url)
        local.parent.mkdir(parents=True, exist_ok=True)
        self._client.download_file(bucket, key, str(local))

    def list(self, url: str) -> list[Entry]:
        bucket, key = _bucket_key(url)
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        entries = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                entries.append(Entry(item["Key"][len(prefix):], int(item["Size"]), str(item.get("ETag", ""))))
        return entries

    def exists(self, url: str) -> bool:
        # lazy: boto3 is needed only for s3:// paths
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(url)
        try:
            self._client.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if _missing(err):
                return False
            raise
        return True

    def stat(self, url: str) -> Entry | None:
        # lazy: boto3 is needed only for s3:// paths
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(url)
        try:
            head = self._client.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if _missing(err):
                return None
            raise
        return Entry(posixpath.basename(key), int(head["ContentLength"]), str(head.get("ETag", "")))

    def read_text(self, url: str) -> str | None:
        # lazy: boto3 is needed only for s3:// paths
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(url)
        try:
            body = self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as err:
            if _missing(err):
                return None
            raise
        return str(body.decode("utf-8"))

    def write_text(self, url: str, text: str) -> None:
        bucket, key = _bucket_key(url)
        self._client.put_object(Bucket=bucket, Key=key, Body=text.encode("utf-8"),
                                ACL="bucket-owner-full-control")

    def delete(self, url: str) -> None:
        """Every object below ``url`` (a checkpoint's prefix)."""
        bucket, key = _bucket_key(url)
        prefix = key.rstrip("/") + "/"
        keys = [{"Key": prefix + entry.key} for entry in self.list(url)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys per request
            self._client.delete_objects(Bucket=bucket, Delete={"Objects": keys[start:start + 1000]})


def _missing(err: Any) -> bool:
    """A botocore ``ClientError`` that says the object is not there."""
    return str(err.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey", "NotFound")


def _endpoint_note() -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f" (endpoint {endpoint}, from AWS_ENDPOINT_URL)" if endpoint else ""


class FsspecStore:
    """Any other scheme, through the fsspec implementation registered for it."""

    def __init__(self, scheme: str) -> None:
        # lazy: fsspec, only for its URL schemes
        import fsspec

        try:
            self.fs: Any = fsspec.filesystem(scheme)
        except ImportError as err:
            raise StoreError(f"{scheme}:// paths need a package that is not installed here ({err})") from err

    def probe(self, url: str, write: bool) -> None:
        bucket = url.partition("://")[2].split("/", 1)[0]
        try:
            found = self.fs.exists(url.partition("://")[0] + "://" + bucket)
        except Exception as err:  # noqa: BLE001 - each fsspec backend raises its own errors
            raise StoreError(f"{url}: the object store cannot be reached ({type(err).__name__}: {err})") from err
        if not found:
            raise StoreError(f"{url}: bucket {bucket!r} does not exist")

    def put_file(self, local: Path, url: str, chunk_size: int) -> None:
        self.fs.put_file(str(local), url)

    def get_file(self, url: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(url, str(local))

    def list(self, url: str) -> list[Entry]:
        # lazy: fsspec, only for its URL schemes
        from fsspec.core import strip_protocol

        base = str(strip_protocol(url)).rstrip("/")
        if not self.fs.exists(url):
            return []
        found = self.fs.find(url, detail=True)
        return [Entry(posixpath.relpath(str(strip_protocol(name)), base), int(info["size"]),
                      str(info.get("ETag") or info.get("mtime") or info.get("created") or ""))
                for name, info in found.items()]

    def exists(self, url: str) -> bool:
        return bool(self.fs.exists(url))

    def stat(self, url: str) -> Entry | None:
        if not self.fs.isfile(url):
            return None
        info = self.fs.info(url)
        version = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified", "created")
                        if info.get(k) is not None), "")
        return Entry(posixpath.basename(url.rstrip("/")), int(info.get("size") or 0), version)

    def read_text(self, url: str) -> str | None:
        if not self.fs.exists(url):
            return None
        return str(self.fs.cat_file(url).decode("utf-8"))

    def write_text(self, url: str, text: str) -> None:
        self.fs.pipe_file(url, text.encode("utf-8"))

    def delete(self, url: str) -> None:
        if self.fs.exists(url):
            self.fs.rm(url, recursive=True)


_STORES: dict[str, Store] = {}


def store_for(url: str) -> Store:
    """The store of ``url``'s scheme (one client per process and scheme)."""
    scheme = scheme_of(url)
    if scheme is None:
        raise StoreError(f"{url} is a local path, not an object store URL")
    if scheme not in _STORES:
        if scheme in ("s3", "s3a"):
            _STORES[scheme] = S3Store()
        else:
            _check_known(scheme, url)
            _STORES[scheme] = FsspecStore(scheme)
    return _STORES[scheme]


def _check_known(scheme: str, url: str) -> None:
    # lazy: fsspec, only for its URL schemes
    import fsspec

    known = set(fsspec.available_protocols())
    if scheme not in known:
        raise StoreError(f"{url}: Deepy cannot read or write {scheme}:// paths (it knows s3:// and the schemes "
                         f"fsspec has an implementation for, such as gs://, az://, hdfs://)")


def check_url(key: str, url: str, where: str = "", *, write: bool, probe: bool = True) -> None:
    """Refuse ``url`` (the value of ``key``) unless Deepy can use it: a known scheme, writable when ``write``,
    its package installed, and (``probe``) its bucket reachable with the standard credentials."""
    scheme = scheme_of(url)
    if scheme is None:
        return
    at = f" ({where})" if where else ""
    if write and scheme in READ_ONLY_SCHEMES:
        raise StoreError(f"{key}{at}: {url} cannot be written ({scheme}:// is read-only); use s3://, gs:// or a "
                         "local directory")
    try:
        if probe:
            store_for(url).probe(url, write)
        else:
            _check_installed(scheme, url)
    except StoreError as err:
        raise StoreError(f"{key}{at}: {err}") from None


def _check_installed(scheme: str, url: str) -> None:
    """``scheme``'s implementation can be imported, without making a client: gcsfs's ``GCSFileSystem()`` looks for
    credentials (google-auth's default chain, then the GCE metadata server: 17 s on a machine outside Google Cloud),
    which a config that is only being read must not wait for."""
    if scheme in ("s3", "s3a") or scheme in _STORES:
        return  # boto3 is a requirement
    _check_known(scheme, url)
    # lazy: fsspec, only for its URL schemes
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as err:
        raise StoreError(f"{scheme}:// paths need a package that is not installed here ({err})") from err


def upload_tree(local_dir: Path, url: str, chunk_size: int, *, last: Iterable[str] = (),
                skip: Iterable[str] = ()) -> list[str]:
    """Every file below ``local_dir`` to ``url/<same relative path>``; ``last`` (relative paths) go after all
    others, in that order (a commit marker), ``skip`` not at all. Returns the relative paths uploaded."""
    store = store_for(url)
    last, skip = list(last), set(skip)
    files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    order = [f for f in files if f not in skip and f not in last] + [f for f in last if f in files]
    for rel in order:
        store.put_file(local_dir / rel, join(url, rel), chunk_size)
    return order


def download_tree(url: str, local_dir: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Every object below ``url`` to ``local_dir/<same relative path>``; returns the relative paths."""
    store = store_for(url)
    skip = set(skip)
    keys = [entry.key for entry in store.list(url) if entry.key not in skip]
    for rel in keys:
        store.get_file(join(url, rel), local_dir / rel)
    return keys
