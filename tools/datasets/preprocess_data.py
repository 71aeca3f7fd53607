#!/usr/bin/env python
"""Tokenize jsonl documents into MMIDIDX datasets (``<prefix>_<key>_document.{bin,idx}``).

Same interface as GPT-NeoX's tool. Input is read as a stream of raw lines, cut into ~1 MB chunks and
handed to worker processes, each of which parses JSON, tokenizes and packs the tokens into a numpy
array; the main process only reads and writes. So memory stays bounded (a few chunks in flight) and
both cores do useful work. The alternative, parsing in the main process and tokenizing with
tiktoken's threads, was measured slower on 2 cores (see tools/bench/preprocess.py).

``--ray ADDRESS`` (a cluster started with ``ray start --head``) or ``--ray``/``--ray local`` (a private Ray
instance on this machine) hands the chunks to ``--workers`` Ray actors instead of local processes
(:mod:`megatron.data.ray_tokenize`); results are written in input order, so the ``.bin``/``.idx`` bytes are
those of the single-machine run.

Bad input stops the run with the file and line: malformed JSON, invalid UTF-8, a missing key, a value
that is not a string, an input without documents. ``--skip-bad`` turns all but the last into counted
skips (an input where no line is usable is still an error). Empty or whitespace-only documents are always skipped and counted.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import itertools
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from megatron.data import ray_tokenize
from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.errors import DataError, run_guarded
from megatron import plugins
from megatron.tokenizer import Tokenizer, build_tokenizer
from megatron.tokenizer.config import TokenizerArgs

CHUNK_BYTES = 1 << 20
MAX_EXAMPLES = 5  # bad lines quoted in the final report


# --- input -----------------------------------------------------------------------------------
def expand_inputs(spec: str) -> list[str]:
    """Comma-separated paths and globs -> files, in the order given (each glob sorted)."""
    files: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if glob.has_magic(item):
            matches = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"{item}: no input file matches this pattern")
            files.extend(matches)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"{item}: input file not found")
    if not files:
        raise DataError("--input names no file")
    return files


def open_lines(path: str) -> BinaryIO:
    """A binary line reader; .gz and .zst are decompressed as a stream."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]  # a BinaryIO the stubs do not say
    if path.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


@dataclass
class Chunk:
    path: str
    first_line: int  # 1-based number of lines[0]
    lines: list[bytes]
    nbytes: int


def read_chunks(files: list[str], chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    for path in files:
        lines: list[bytes] = []
        size, first = 0, 1
        lineno = 0
        try:
            with open_lines(path) as fh:
                for lineno, line in enumerate(fh, start=1):
                    lines.append(line)
                    size += len(line)
                    if size >= chunk_bytes:
                        yield Chunk(path, first, lines, size)
                        lines, size, first = [], 0, lineno + 1
        except (OSError, EOFError) as err:  # corrupt gzip, unreadable file
            raise DataError(f"{path}:{lineno + 1}: cannot read input ({err})") from None
        except Exception as err:
            if type(err).__module__.startswith("zstandard"):
                raise DataError(f"{path}:{lineno + 1}: cannot decompress input ({err})") from None
            raise
        if lines:
            yield Chunk(path, first, lines, size)


# --- encoding (runs in workers) ---------------------------------------------------------------
@dataclass
class EncodeOptions:
    keys: list[str]
    append_eod: bool
    ftfy: bool
    skip_bad: bool
    dtype: Any


@dataclass
class Encoded:
    """One chunk's result: per key the concatenated tokens and per-document sizes."""

    tokens: dict[str, np.ndarray]
    sizes: dict[str, np.ndarray]
    docs: int = 0
    nbytes: int = 0
    empty: dict[str, int] = field(default_factory=dict)
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)


_worker: dict[str, Any] = {}


def init_worker(tokenizer: Tokenizer, options: EncodeOptions, threads: int) -> None:
    tokenizer.num_threads = threads
    _worker["tokenizer"] = tokenizer
    _worker["options"] = options


class _BadLine(Exception):
    """A line that --skip-bad may skip (malformed JSON, invalid UTF-8, a missing or non-text key)."""


def _has_lone_surrogate(text: str, line: bytes) -> bool:
    # json.loads turns a "\ud800" escape into a lone surrogate that no UTF-8 writer accepts; only
    # lines containing such an escape need the (costly) check.
    if b"\\ud" not in line and b"\\uD" not in line:
        return False
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def parse_line(line: bytes, keys: list[str], where: str) -> list[str]:
    """The values of ``keys`` in one jsonl line; _BadLine or DataError (with ``where``) if unusable."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _BadLine(f"invalid UTF-8 at byte {err.start}") from None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as err:
        reason = err.msg.removesuffix(" at")  # some messages end in "at" before the position
        raise _BadLine(f"malformed JSON ({reason} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise _BadLine(f"malformed JSON (expected an object, got {type(record).__name__})")
    values = []
    for key in keys:
        if key not in record:
            found = ", ".join(sorted(record)) or "none"
            # skippable with --skip-bad like any bad line; when every line lacks it, the "no documents"
            # error that follows names the key and --jsonl-keys
            raise _BadLine(f"missing key {key!r} (keys here: {found}); choose the field with --jsonl-keys")
        value = record[key]
        if not isinstance(value, str):
            raise _BadLine(f"key {key!r} holds {type(value).__name__}, expected a string")
        if _has_lone_surrogate(value, line):
            raise _BadLine("invalid UTF-8 (lone surrogate escape)")
        values.append(value)
    return values


def encode_chunk(chunk: Chunk) -> Encoded:
    return encode_with(_worker["tokenizer"], _worker["options"], chunk)


def ray_setup(tokenizer: Tokenizer, options: EncodeOptions) -> tuple[Tokenizer, EncodeOptions]:
    """A Ray actor's state: the tokenizer (one thread: each actor holds one CPU) and the options."""
    tokenizer.num_threads = 1
    return tokenizer, options


def ray_encode(state: tuple[Tokenizer, EncodeOptions], chunk: Chunk) -> Encoded:
    return encode_with(state[0], state[1], chunk)


def encode_with(tok: Tokenizer, opt: EncodeOptions, chunk: Chunk) -> Encoded:
    texts: dict[str, list[str]] = {k: [] for k in opt.keys}
    out = Encoded(tokens={}, sizes={}, nbytes=chunk.nbytes, empty={k: 0 for k in opt.keys})
    fix_text = None
    if opt.ftfy:
        import ftfy

        fix_text = ftfy.fix_text

    for lineno, line in enumerate(chunk.lines, start=chunk.first_line):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not documents
        where = f"{chunk.path}:{lineno}"
        try:
            values = parse_line(line, opt.keys, where)
        except _BadLine as err:
            if not opt.skip_bad:
                raise DataError(f"{where}: {err} (use --skip-bad to skip such lines)") from None
            out.bad += 1
            if len(out.bad_examples) < MAX_EXAMPLES:
                out.bad_examples.append(f"{where}: {err}")
            continue
        out.docs += 1
        for key, value in zip(opt.keys, values):
            if value.strip():
                texts[key].append(fix_text(value) if fix_text else value)
            else:
                out.empty[key] += 1

    for key, docs in texts.items():
        out.tokens[key], out.sizes[key] = pack(tok.tokenize_batch(docs), tok.eod if opt.append_eod else None,
                                               opt.dtype)
    return out


def pack(ids: list[list[int]], eod: int | None, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents' ids (each followed by ``eod`` if given) into one array + sizes."""
    sizes = np.fromiter((len(d) for d in ids), dtype=np.int64, count=len(ids))
    total = int(sizes.sum())
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total)
    if eod is not None:
        # One vectorised insert instead of a Python append per document.
        flat = np.insert(flat, np.cumsum(sizes), np.asarray(eod, dtype=dtype))
        sizes += 1
    return flat, sizes.astype(np.int32)


# --- driving ------------------------------------------------------------------------------------
def run_encoding(chunks: Iterator[Chunk], tokenizer: Tokenizer, options: EncodeOptions, workers: int,
                 parallelism: str, on_ray: bool = False) -> Iterator[Encoded]:
    """Encoded chunks in input order; at most a few chunks are in flight at once. ``on_ray``: on ``workers``
    actors of the Ray cluster this process is connected to."""
    if on_ray:
        yield from ray_tokenize.ordered_map(ray_setup, (tokenizer, options), ray_encode, chunks, workers, "--ray")
        return
    if workers <= 1 or parallelism == "threads":
        init_worker(tokenizer, options, threads=max(1, workers))
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    ctx = multiprocessing.get_context("fork")
    # HF tokenizers disables its own thread pool after a fork anyway; saying so silences its warning.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = ctx.Pool(workers, initializer=init_worker, initargs=(tokenizer, options, 1))
    pending: deque[Any] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


class Progress:
    """Documents done, with MB/s and tokens/s: a tqdm bar on a terminal, a line every 10 s in a log."""

    def __init__(self, total_docs: int | None, log_interval: int, quiet: bool) -> None:
        from megatron.logging.progress import progress

        self.bar = progress(total_docs, "tokenizing", "doc", enabled=not quiet)
        self.start = time.perf_counter()
        self.docs = self.bytes = self.tokens = 0
        self.log_interval = max(1, log_interval)
        self._next_log = self.log_interval

    def update(self, enc: Encoded) -> None:
        self.docs += enc.docs
        self.bytes += enc.nbytes
        self.tokens += sum(int(t.size) for t in enc.tokens.values())
        self.bar.update(enc.docs)
        if self.docs >= self._next_log:
            self._next_log = self.docs + self.log_interval
            dt = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.bytes / dt / 1e6:.1f} MB/s, {self.tokens / dt / 1e6:.2f}M tok/s",
                                     refresh=False)

    def close(self) -> float:
        self.bar.close()
        return time.perf_counter() - self.start


def verify_on_sample(tokenizer: Tokenizer, chunk: Chunk, keys: list[str], limit: int = 256) -> None:
    """Let a tokenizer with a fast path check it against its reference on the input's first documents."""
    check = getattr(tokenizer, "verify_fast_path", None)
    if check is None:
        return
    sample: list[str] = []
    for line in chunk.lines[:limit]:
        try:
            sample.extend(v for v in parse_line(line, keys, "") if v.strip())
        except (_BadLine, DataError):
            continue  # reported properly when the chunk is encoded
    check(sample)


def preprocess(args: argparse.Namespace) -> dict[str, Any]:
    if args.ray is None:
        return _preprocess(args, args.workers or 1)
    ray_tokenize.require_ray("--ray")  # before any work: a clear refusal when Ray is not installed
    with ray_tokenize.ray_cluster(args.ray, "--ray", local_cpus=args.workers) as cpus:
        stats = _preprocess(args, args.workers or cpus)
    return stats


def _preprocess(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    files = expand_inputs(args.input)
    tokenizer = build_tokenizer(TokenizerArgs(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                                              merge_file=args.merge_file))
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    options = EncodeOptions(keys=args.jsonl_keys, append_eod=args.append_eod, ftfy=args.ftfy,
                            skip_bad=args.skip_bad, dtype=dtype)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.jsonl_keys}
    builders = {k: MMapIndexedDatasetBuilder(data_file_path(p), dtype) for k, p in prefixes.items()}
    progress = Progress(args.num_docs, args.log_interval, args.quiet)
    empty = {k: 0 for k in args.jsonl_keys}
    docs_out = {k: 0 for k in args.jsonl_keys}
    bad, examples = 0, list[str]()
    try:
        chunks = read_chunks(files)
        first = next(chunks, None)
        if first is not None:
            chunks = itertools.chain([first], chunks)
            verify_on_sample(tokenizer, first, args.jsonl_keys)
        for enc in run_encoding(chunks, tokenizer, options, workers, args.parallelism, on_ray=args.ray is not None):
            for k in args.jsonl_keys:
                builders[k].add_documents(enc.tokens[k], enc.sizes[k])
                empty[k] += enc.empty[k]
                docs_out[k] += len(enc.sizes[k])
            bad += enc.bad
            examples.extend(enc.bad_examples[: MAX_EXAMPLES - len(examples)])
            progress.update(enc)
        seconds = progress.close()
        for k in args.jsonl_keys:
            if docs_out[k] == 0:
                first_bad = f"; first bad line: {examples[0]}" if examples else ""
                raise DataError(f"{', '.join(files)}: no documents with text under key {k!r} "
                                f"({empty[k]} empty, {bad} bad lines){first_bad}; refusing to write an empty dataset")
        for k, p in prefixes.items():
            builders[k].finalize(index_file_path(p))
    except BaseException:
        progress.bar.close()
        for b in builders.values():
            b.abort()
        raise
    return {"files": files, "prefixes": prefixes, "docs": docs_out, "empty": empty, "bad": bad,
            "bad_examples": examples, "tokens": progress.tokens, "bytes": progress.bytes,
            "seconds": seconds, "backend": tokenizer.backend, "dtype": np.dtype(dtype).name,
            "ray_workers": workers if args.ray is not None else 0}


def report(stats: dict[str, Any]) -> None:
    dt = max(stats["seconds"], 1e-9)
    print(f"tokenized {sum(stats['docs'].values()):,} documents, {stats['tokens']:,} tokens, "
          f"{stats['bytes'] / 1e6:.1f} MB in {dt:.2f} s: {stats['tokens'] / dt / 1e6:.2f}M tokens/s, "
          f"{stats['bytes'] / dt / 1e6:.1f} MB/s ({stats['backend']} backend, {stats['dtype']} tokens"
          + (f", {stats['ray_workers']} Ray workers)" if stats.get("ray_workers") else ")"))
    for key, n in stats["empty"].items():
        if n:
            print(f"skipped {n:,} empty or whitespace-only documents under key {key!r}")
    if stats["bad"]:
        print(f"skipped {stats['bad']:,} bad lines (--skip-bad), for example:")
        for line in stats["bad_examples"]:
            print(f"  {line}")
    for prefix in stats["prefixes"].values():
        print(f"wrote {data_file_path(prefix)} and {index_file_path(prefix)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="jsonl files (.jsonl, .jsonl.gz, .jsonl.zst): comma-separated paths and/or globs")
    g.add_argument("--jsonl-keys", nargs="+", default=["text"], help="keys to extract; one dataset per key")
    g.add_argument("--num-docs", type=int, default=None, help="number of documents, if known (progress bar)")
    g.add_argument("--skip-bad", action="store_true",
                   help="skip malformed JSON and invalid UTF-8 lines (counted and reported) instead of stopping")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=sorted(plugins.names("tokenizer_type")))
    g.add_argument("--vocab-file", default=None, help="tokenizer file (tokenizer.json, vocab.json, .model, ...)")
    g.add_argument("--merge-file", default=None, help="merges.txt for GPT2BPETokenizer")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g.add_argument("--ftfy", action="store_true", help="repair mojibake with ftfy before tokenizing")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.{bin,idx}")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only the mmap format exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=None,
                   help="worker processes (or tokenizer threads), default 1; with --ray: Ray actors, default one "
                        "per CPU of the cluster")
    g.add_argument("--parallelism", default="processes", choices=["processes", "threads"],
                   help="processes: workers parse and tokenize; threads: main parses, tiktoken threads tokenize")
    g.add_argument("--ray", nargs="?", const=ray_tokenize.LOCAL, default=None, metavar="ADDRESS",
                   help="tokenize on a Ray cluster: the address `ray start --head` printed (host:port, ray://..., "
                        "auto), or `local` (also the value of a bare --ray) for a private Ray instance on this "
                        "machine; the output bytes are those of the run without --ray")
    g.add_argument("--log-interval", type=int, default=10_000, help="documents between throughput updates")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    args = p.parse_args(argv)
    if args.ray is not None and args.parallelism == "threads":
        p.error("--parallelism threads tokenizes in this process; with --ray the Ray workers tokenize: drop one")
    if args.workers is not None and args.workers < 1:
        p.error("--workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    report(preprocess(args))
    return 0


def cli() -> None:
    """The ``deepy-preprocess-data`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
