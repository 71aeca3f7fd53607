"""Levanter-style raw-text sources: ``train_urls``/``validation_urls`` tokenized into a local cache.

A source is a list of jsonl shards (plain, ``.gz`` or ``.zst``) given as local paths with shell brace
patterns: ``shard-{001..128}.jsonl.gz`` or ``{train,extra}.jsonl`` (shards in object storage, ``s3://...``, are
downloaded first and arrive here as local copies: ``remote_data.py``). On first use the shards are
tokenized (``text`` field, EOD after each document) into one MMIDIDX dataset under ``cache_dir``;
later runs and other ranks read that dataset. The cache name hashes the shards' *content* and the
tokenizer, so editing a shard or switching tokenizer re-tokenizes, and racing ranks tokenize once.
With ``tokenize_ray_address`` the building rank hands chunks of lines to actors on a Ray cluster
(:mod:`megatron.data.ray_tokenize`) and writes their tokens in input order: the same bytes.

Training starts when the whole cache is written, not on the part already built as Levanter does
(``src/levanter/store/cache.py:242-275``@9263f81e: a read waits until the growing cache holds its rows): the
offline sample index shuffles over every document of the split and sizes epochs by its token count, so no sample
order can be fixed before the last shard is tokenized. The start-at-once path is ``streaming`` (docs/streaming.md).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megatron.data import ray_tokenize
from megatron.data.index_cache import build_once, file_content_key
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.errors import DataError

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
DEFAULT_CACHE_DIR = "cache/urls"
RAY_CHUNK_CHARS = 1 << 20
"""Characters of jsonl lines per chunk handed to a Ray actor."""
RAY_KEY = "tokenize_ray_address"


def _top_level_group(pattern: str) -> tuple[int, int] | None:
    """Span of the first top-level ``{...}`` group, or None when there is none."""
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                return start, i
    if depth:
        raise DataError(f"unbalanced '{{' in url pattern {pattern!r}")
    return None


def _split_top_level(body: str) -> list[str]:
    parts, depth, cur = [], 0, list[str]()
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def _alternatives(body: str, pattern: str) -> list[str]:
    m = _RANGE.match(body)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        step = abs(int(m.group(3) or 1)) or 1
        # bash pads to the wider endpoint when either is written with a leading zero
        padded = any(re.match(r"^-?0\d", g) for g in (m.group(1), m.group(2)))
        width = max(len(m.group(1)), len(m.group(2))) if padded else 0
        values = range(a, b + 1, step) if a <= b else range(a, b - 1, -step)
        return [str(v).zfill(width) if width else str(v) for v in values]
    parts = _split_top_level(body)
    if len(parts) < 2:
        raise DataError(f"brace group {{{body}}} in {pattern!r} needs a comma list or a range like 1..8")
    return parts


def expand_braces(pattern: str) -> list[str]:
    """Shell brace expansion, left to right: ``a{1..3}`` -> a1 a2 a3; ``{x,y{1,2}}`` -> x y1 y2."""
    group = _top_level_group(pattern)
    if group is None:
        return [pattern]
    lo, hi = group
    head, body, tail = pattern[:lo], pattern[lo + 1 : hi], pattern[hi + 1 :]
    out: list[str] = []
    for alt in _alternatives(body, pattern):
        out.extend(expand_braces(head + alt + tail))
    return out


def expand_urls(urls: list[str]) -> list[str]:
    """Expand every pattern into local files (``remote_data.localized`` has replaced the shards in object storage by
    their downloaded copies; any other URL is a clear error)."""
    paths: list[str] = []
    for url in urls:
        for p in expand_braces(url):
            if "://" in p and not p.startswith("file://"):
                raise DataError(f"{p}: train_urls/validation_urls are local files or objects in a bucket (s3://, "
                                "gs://, ...: downloaded before this point); Deepy downloads nothing else")
            p = p.removeprefix("file://")
            if not os.path.isfile(p):
                raise DataError(f"{p}: shard not found (from pattern {url!r}); run `python prepare_data.py` "
                                "or fix the path")
            paths.append(p)
    if not paths:
        raise DataError("train_urls/validation_urls expanded to no files")
    return paths


def open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    if path.endswith(".zst"):
        # lazy: zstandard, only for .zst files
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_texts(path: str, text_key: str = "text") -> Iterator[str]:
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield text_of(line, path, lineno, text_key)


def text_of(line: str, path: str, lineno: int, text_key: str) -> str:
    """The ``text_key`` string of one jsonl line, or a DataError at ``path:lineno``."""
    try:
        record = json.loads(line)
        text = record[text_key]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} string") from None
    if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: {text_key!r} must be a string")
    return text


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identity of a tokenizer for cache keys: its type, sizes and how it splits a probe string."""
    probe = "Deepy cache probe: Hello, world! 123 \u00e9\u4e2d"
    parts = [type(tokenizer).__name__, str(tokenizer.vocab_size), str(tokenizer.eod), str(tokenizer.tokenize(probe))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def materialize_urls(urls: list[str], cache_dir: str | None, tokenizer: Any, text_key: str = "text",
                     batch_size: int = 1024, ray_address: str | None = None) -> str:
    """Tokenize the shards once into ``cache_dir``; return the dataset prefix to read. ``ray_address``
    (``tokenize_ray_address``): tokenize on that Ray cluster (or a private local one for ``local``)."""
    paths = expand_urls(list(urls))
    h = hashlib.sha256()
    for p in paths:
        h.update(file_content_key(p).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    h.update(text_key.encode())
    root = Path(cache_dir or DEFAULT_CACHE_DIR)
    prefix = str(root / f"urls_{h.hexdigest()[:20]}_text_document")

    def build() -> None:
        logger.info("tokenizing %d shards into %s", len(paths), prefix)
        dtype = best_fitting_dtype(tokenizer.vocab_size)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
        try:
            if ray_address is None:
                _build_here(builder, paths, tokenizer, text_key, batch_size)
            else:
                _build_on_ray(builder, paths, tokenizer, text_key, dtype, ray_address)
            # The .idx is published last (atomically), so its existence marks a complete dataset.
            builder.finalize(prefix + ".idx")
        except BaseException:
            builder.abort()
            raise

    build_once(prefix + ".idx", build)
    return prefix


def _build_here(builder: MMapIndexedDatasetBuilder, paths: list[str], tokenizer: Any, text_key: str,
                batch_size: int) -> None:
    for p in paths:
        batch: list[str] = []
        for text in iter_texts(p, text_key):
            batch.append(text)
            if len(batch) == batch_size:
                _add(builder, tokenizer, batch)
                batch = []
        _add(builder, tokenizer, batch)


def _build_on_ray(builder: MMapIndexedDatasetBuilder, paths: list[str], tokenizer: Any, text_key: str, dtype: Any,
                  address: str) -> None:
    with ray_tokenize.ray_cluster(address, RAY_KEY) as cpus:
        logger.info("tokenizing on Ray (%s): %d actors", address, cpus)
        for tokens, sizes in ray_tokenize.ordered_map(_ray_setup, (tokenizer, text_key, dtype), _ray_tokenize,
                                                      _line_chunks(paths), cpus, RAY_KEY):
            builder.add_documents(tokens, sizes)


def _line_chunks(paths: list[str]) -> Iterator[tuple[str, int, list[str]]]:
    """(path, number of the first line, lines) of about RAY_CHUNK_CHARS characters each, read as iter_texts
    reads them (text mode: the same line breaks)."""
    for path in paths:
        with open_text(path) as f:
            lines: list[str] = []
            first, size = 1, 0
            for lineno, line in enumerate(f, 1):
                lines.append(line)
                size += len(line)
                if size >= RAY_CHUNK_CHARS:
                    yield path, first, lines
                    lines, first, size = [], lineno + 1, 0
            if lines:
                yield path, first, lines


def _ray_setup(tokenizer: Any, text_key: str, dtype: Any) -> tuple[Any, str, Any]:
    tokenizer.num_threads = 1  # each actor holds one CPU
    return tokenizer, text_key, dtype


def _ray_tokenize(state: tuple[Any, str, Any], chunk: tuple[str, int, list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's documents, each followed by EOD, concatenated, and their sizes (as _add writes them)."""
    tokenizer, text_key, dtype = state
    path, first, lines = chunk
    texts = [text_of(line, path, lineno, text_key) for lineno, line in enumerate(lines, first) if line.strip()]
    docs = [np.asarray(list(ids) + [tokenizer.eod], dtype=np.int64) for ids in tokenizer.tokenize_batch(texts)]
    sizes = np.fromiter((d.size for d in docs), dtype=np.int32, count=len(docs))
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    return np.ascontiguousarray(flat, dtype=dtype), sizes


def _add(builder: MMapIndexedDatasetBuilder, tokenizer: Any, texts: list[str]) -> None:
    if not texts:
        return
    for ids in tokenizer.tokenize_batch(texts):
        builder.add_item(np.asarray(list(ids) + [tokenizer.eod], dtype=np.int64))
        builder.end_document()
