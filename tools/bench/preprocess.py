#!/usr/bin/env python
"""Benchmark ``tools/datasets/preprocess_data.py`` against HF ``tokenizers.encode_batch``.

Builds, deterministically, a corpus from the Python standard library's docstrings of at least 200
characters as ``{"text": ...}`` lines, repeated 20 times (~26 MB), and tokenizes it with the
byte-level BPE tokenizer the README's quick start trains (``data/pydocs/tokenizer.json``, from
``python prepare_data.py``; ``--tokenizer`` takes another). Then, in one run:

1. our tool end to end (a subprocess, so interpreter start and imports count), ``--append-eod``;
2. HF ``Tokenizer.encode_batch`` on the same documents in this process (the ceiling of a tool built
   on HF tokenizers);
3. checks that the dataset we wrote holds exactly HF's ids (+ eod) for every document.

Prints tokens/s of both and their ratio, by wall clock and per CPU second (steadier when other jobs
share the cores). Numbers on a shared 2-core machine are noisy: use ``--runs 3`` (best of three). ``--modes processes,threads`` also times the tool's thread-based mode.
Each phase prints a line when it starts and what it measured when it ends (a run takes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = Path("data") / "pydocs" / "tokenizer.json"
"""The quick start's tokenizer (``python prepare_data.py``), relative to the working directory."""


def say(line: str) -> None:
    print(line, flush=True)


def build_corpus(path: Path, repeats: int, min_chars: int) -> int:
    """Write the benchmark corpus; returns the number of documents."""
    # prepare_data.py is a script beside the packages, not a module of one: take its function from the file
    stdlib_docstrings = runpy.run_path(str(REPO / "prepare_data.py"), run_name="prepare_data")["stdlib_docstrings"]
    docs = stdlib_docstrings(min_chars=min_chars, include_private=True)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(repeats):
            for doc in docs:
                fh.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return len(docs) * repeats


def children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def self_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def run_tool(corpus: Path, tokenizer: Path, prefix: Path, workers: int, mode: str) -> tuple[float, float, str]:
    """Wall and CPU seconds (the tool and its workers) of one end-to-end run."""
    cmd = [sys.executable, str(REPO / "tools" / "datasets" / "preprocess_data.py"), "--input", str(corpus),
           "--output-prefix", str(prefix), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tokenizer),
           "--append-eod", "--workers", str(workers), "--parallelism", mode, "--quiet"]
    cpu0, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu0
    if proc.returncode != 0:
        sys.exit(f"preprocess_data failed ({proc.returncode}):\n{proc.stderr}")
    return wall, cpu, proc.stdout


def peak_rss_children_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                   help=f"a byte-level BPE tokenizer.json (default: {DEFAULT_TOKENIZER}, from python prepare_data.py)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--min-chars", type=int, default=200)
    p.add_argument("--modes", default="processes", help="comma-separated: processes,threads")
    p.add_argument("--runs", type=int, default=1, help="time each side this many times and keep the best")
    p.add_argument("--workdir", default=None, help="keep the corpus and outputs here (default: a temp dir)")
    args = p.parse_args()
    if not Path(args.tokenizer).is_file():
        sys.exit(f"--tokenizer {args.tokenizer} does not exist: run `python prepare_data.py` (the README's quick "
                 f"start) for the default one, or give a byte-level BPE tokenizer.json")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "stdlib_docstrings.jsonl"
        say(f"building the corpus ({args.repeats} copies of the standard library's docstrings)...")
        n_docs = build_corpus(corpus, args.repeats, args.min_chars)
        mb = corpus.stat().st_size / 1e6
        print(f"corpus: {n_docs:,} docs, {mb:.1f} MB ({corpus})")

        # Best of --runs: on a shared machine the fastest run is the one least disturbed by others.
        results: dict[str, tuple[float, float, Path]] = {}
        for mode in args.modes.split(","):
            prefix = work / f"bench_{mode}"
            for run in range(args.runs):
                say(f"ours [{mode}]: run {run + 1}/{args.runs} of tools/datasets/preprocess_data.py...")
                wall, cpu, out = run_tool(corpus, Path(args.tokenizer), prefix, args.workers, mode)
                inner = re.search(r"in ([\d.]+) s", out)
                print(f"ours [{mode}, {args.workers} workers]: {wall:.2f} s wall end to end, {cpu:.2f} CPU s"
                      + (f" ({inner.group(1)} s inside the tool)" if inner else ""))
                if mode not in results or wall < results[mode][0]:
                    results[mode] = (wall, cpu, prefix)
        print(f"peak RSS of our tool (largest process): {peak_rss_children_mb():.0f} MB")

        # HF on the same documents, in this process (reading the corpus is not timed).
        import tokenizers

        texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
        hf = tokenizers.Tokenizer.from_file(args.tokenizer)
        hf_time, hf_cpu, hf_ids = float("inf"), 0.0, []
        for run in range(args.runs):
            say(f"HF encode_batch: run {run + 1}/{args.runs}...")
            cpu0, start = self_cpu(), time.perf_counter()
            encodings = hf.encode_batch(texts)
            wall, cpu = time.perf_counter() - start, self_cpu() - cpu0
            print(f"HF encode_batch: {wall:.2f} s wall, {cpu:.2f} CPU s")
            if wall < hf_time:
                hf_time, hf_cpu = wall, cpu
            hf_ids = [e.ids for e in encodings]
        n_tokens = sum(map(len, hf_ids)) + len(hf_ids)  # + eod, as our tool writes
        eod = hf.token_to_id("<|endoftext|>")

        print(f"HF encode_batch (best): {n_tokens / hf_time / 1e6:.2f}M tokens/s, "
              f"{n_tokens / hf_cpu / 1e6:.2f}M tokens per CPU s ({n_tokens:,} tokens incl. eod)")
        for mode, (wall, cpu, prefix) in results.items():
            say(f"ours [{mode}]: comparing {len(hf_ids):,} documents' ids with HF's...")
            ds = MMapIndexedDataset(f"{prefix}_text_document")
            same = len(ds) == len(hf_ids) and all(
                np.array_equal(ds[i], np.asarray(ids + [eod])) for i, ids in enumerate(hf_ids))
            print(f"ours [{mode}] (best): {n_tokens / wall / 1e6:.2f}M tokens/s end to end, "
                  f"{hf_time / wall:.2f}x HF encode_batch; {n_tokens / cpu / 1e6:.2f}M tokens per CPU s "
                  f"({hf_cpu / cpu:.2f}x HF); ids identical to HF: {same}")
            if not same:
                return 1
            for suffix in (".bin", ".idx"):
                os.remove(f"{prefix}_text_document{suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
