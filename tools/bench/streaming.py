#!/usr/bin/env python
"""Can the data keep up? Side by side in one run, on this machine:

1. the training step's consumption: tokens/s of Deepy's ``train_step`` (``tools/bench/compare.py --contenders
   deepy``, a subprocess per shape) at the tiny shape (``configs/tiny.yml``: 2 x 64, seq 128, micro-batch 4) and
   the 125M shape (``configs/125M.yml``: 12 x 768, seq 2048, vocab 50304; micro-batch 1 on a CPU, where one step
   of 4 sequences takes minutes: a step's cost per token hardly depends on the batch);
2. the streaming loader (``streaming: true``, :class:`megatron.data.streaming.StreamingDataset`): tokens/s of
   samples cut at each shape's seq_length from raw jsonl, tokenized on the fly, read as a rank reads them
   (one stream, and as many streams as the global batch); the ratio to (1) is the loader's headroom;
3. preprocessing the same jsonl ahead of training: ``tools/datasets/preprocess_data.py`` end to end
   (a subprocess: start-up, Ray's start and actors count) on this machine's processes, and on a private local
   Ray instance (``--ray local``) with 1 and with 2 Ray workers; every output is checked byte-identical.

The corpus is the one ``tools/bench/preprocess.py`` builds (the standard library's docstrings as ``{"text": ...}``
lines, ``--repeats`` copies), tokenized with the quick start's BPE tokenizer (``data/pydocs/tokenizer.json``, from
``python prepare_data.py``). Each phase prints a line when it starts; a run takes a few minutes on 2 cores, most
of it the 125M steps (``--skip-125m`` leaves them out).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron.data.streaming import StreamingDataset
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.config import TokenizerArgs
from tools.bench.preprocess import DEFAULT_TOKENIZER, build_corpus, say

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    """Sequences per timed step."""
    streams: int
    """The config's global batch on one rank: the loader's stream_shards default (one stream per sample of a batch)."""
    vocab: int
    warmup: int
    block: int
    rounds: int


SHAPES = (
    Shape("tiny", layers=2, hidden=64, heads=4, seq=128, batch=4, streams=4, vocab=8192, warmup=3, block=10, rounds=3),
    Shape("125M", layers=12, hidden=768, heads=12, seq=2048, batch=1, streams=4, vocab=50304, warmup=1, block=1,
          rounds=1),
)


def train_tokens_per_s(shape: Shape) -> float:
    """Median tokens/s of Deepy's train_step at ``shape`` (compare.py's ``deepy`` contender, dummy data)."""
    cmd = [sys.executable, str(REPO / "tools" / "bench" / "compare.py"), "--contenders", "deepy",
           "--layers", str(shape.layers), "--hidden", str(shape.hidden), "--heads", str(shape.heads),
           "--seq", str(shape.seq), "--batch", str(shape.batch), "--vocab", str(shape.vocab),
           "--warmup", str(shape.warmup), "--block", str(shape.block), "--rounds", str(shape.rounds),
           "--matmul-size", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    row = re.search(r"^deepy\s+([\d,]+)\s", proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or row is None:
        sys.exit(f"compare.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return float(row.group(1).replace(",", ""))


def loader_tokens_per_s(corpus: Path, tokenizer_file: Path, seq: int, streams: int, tokens: int) -> float:
    """Tokens/s of the streaming dataset's first samples (``seq`` new tokens each) over ``streams`` streams, read in
    global order by one rank that reads every stream."""
    tokenizer = build_tokenizer(TokenizerArgs(tokenizer_type="HFTokenizer", vocab_file=str(tokenizer_file)))
    samples = max(streams, tokens // seq)
    ds = StreamingDataset([str(corpus)], tokenizer, seq, streams, samples)
    start = time.perf_counter()
    for i in range(samples):
        ds[i]
    return samples * seq / (time.perf_counter() - start)


@dataclass
class Preprocessed:
    label: str
    wall: float
    inside: float
    tokens: int
    prefix: Path


def preprocess(corpus: Path, tokenizer_file: Path, prefix: Path, label: str, *extra: str) -> Preprocessed:
    cmd = [sys.executable, str(REPO / "tools" / "datasets" / "preprocess_data.py"), "--input", str(corpus),
           "--output-prefix", str(prefix), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tokenizer_file),
           "--append-eod", "--quiet", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    wall = time.perf_counter() - start
    found = re.search(r"([\d,]+) tokens, .* in ([\d.]+) s", proc.stdout)
    if proc.returncode != 0 or found is None:
        sys.exit(f"preprocess_data {' '.join(extra)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return Preprocessed(label, wall, float(found.group(2)), int(found.group(1).replace(",", "")),
                        Path(f"{prefix}_text_document"))


def same_bytes(a: Path, b: Path) -> bool:
    return all(Path(f"{a}{ext}").read_bytes() == Path(f"{b}{ext}").read_bytes() for ext in (".bin", ".idx"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                   help=f"a byte-level BPE tokenizer.json (default: {DEFAULT_TOKENIZER}, from python prepare_data.py)")
    p.add_argument("--repeats", type=int, default=10, help="copies of the docstring corpus (~1.3 MB each)")
    p.add_argument("--loader-tokens", type=int, default=2_000_000, help="tokens the streaming loader cuts per case")
    p.add_argument("--runs", type=int, default=1, help="preprocessing runs per case; the best is kept (a shared "
                   "machine only ever slows a run down)")
    p.add_argument("--skip-125m", action="store_true", help="leave the 125M shape out (its steps take minutes)")
    p.add_argument("--workdir", default=None, help="keep the corpus and outputs here (default: a temp dir)")
    args = p.parse_args(argv)
    tokenizer = Path(args.tokenizer)
    if not tokenizer.is_file():
        sys.exit(f"--tokenizer {tokenizer} does not exist: run `python prepare_data.py` (the README's quick start) "
                 "for the default one, or give a byte-level BPE tokenizer.json")
    shapes = [s for s in SHAPES if not (args.skip_125m and s.name == "125M")]

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "stdlib_docstrings.jsonl"
        say(f"building the corpus ({args.repeats} copies of the standard library's docstrings)...")
        docs = build_corpus(corpus, args.repeats, 200)
        say(f"corpus: {docs:,} documents, {corpus.stat().st_size / 1e6:.1f} MB ({corpus})")

        rows = []
        for shape in shapes:
            say(f"[{shape.name}] train_step tokens/s ({shape.layers} x {shape.hidden}, seq {shape.seq}, "
                f"batch {shape.batch}, vocab {shape.vocab}; compare.py --contenders deepy)...")
            train = train_tokens_per_s(shape)
            say(f"[{shape.name}] train_step: {train:,.0f} tokens/s; streaming loader, 1 stream and {shape.streams} "
                "streams...")
            one = loader_tokens_per_s(corpus, tokenizer, shape.seq, 1, args.loader_tokens)
            many = loader_tokens_per_s(corpus, tokenizer, shape.seq, shape.streams, args.loader_tokens)
            rows.append((shape, train, one, many))

        runs = []
        for label, extra in (("this machine, 1 process", ["--workers", "1"]),
                             ("this machine, 2 processes", ["--workers", "2"]),
                             ("Ray (--ray local), 1 worker", ["--ray", "local", "--workers", "1"]),
                             ("Ray (--ray local), 2 workers", ["--ray", "local", "--workers", "2"])):
            say(f"preprocess_data.py {' '.join(extra)} ({args.runs} run{'s' if args.runs > 1 else ''})...")
            tries = [preprocess(corpus, tokenizer, work / re.sub(r"\W+", "_", label), label, *extra)
                     for _ in range(args.runs)]
            runs.append(min(tries, key=lambda r: r.wall))

        load = os.getloadavg()
        print()
        print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; corpus "
              f"{docs:,} documents, {runs[0].tokens:,} tokens")
        print(f"{'shape':<6} {'train_step tok/s':>17} {'loader 1 stream':>16} {'loader S=4':>15} {'headroom':>9}")
        for shape, train, one, many in rows:
            print(f"{shape.name:<6} {train:>17,.0f} {one:>16,.0f} {many:>15,.0f} {min(one, many) / train:>8,.1f}x")
        print()
        base = runs[0]
        print(f"{'preprocessing (best of ' + str(args.runs) + ')':<30} {'end to end s':>12} {'tokenizing s':>13} "
              f"{'tok/s':>10} {'speed-up':>9}  bytes")
        for r in runs:
            identical = "identical" if same_bytes(r.prefix, base.prefix) else "DIFFER"
            print(f"{r.label:<30} {r.wall:>12.2f} {r.inside:>13.2f} {r.tokens / r.inside:>10,.0f} "
                  f"{base.inside / r.inside:>8.2f}x  {identical}")
        ray1, ray2 = runs[2], runs[3]
        print(f"Ray, 2 workers against 1: {ray1.inside / ray2.inside:.2f}x tokenizing, {ray1.wall / ray2.wall:.2f}x end "
              "to end")
        return 0 if all(same_bytes(r.prefix, base.prefix) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
