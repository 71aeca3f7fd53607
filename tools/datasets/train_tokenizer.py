#!/usr/bin/env python
"""Train a byte-level BPE tokenizer (GPT-2 style) on jsonl or text files with HF ``tokenizers``.

The result is a ``tokenizer.json`` for ``tokenizer_type: HFTokenizer`` whose layout (every byte in the
alphabet, merge results numbered in merge order, no normalizer) lets Deepy encode it with the fast
tiktoken path, written in the form both GPT-NeoX's pinned tokenizers (0.15.2) and current ones read. ``<|endoftext|>`` is a special token (the end-of-document id). Training is
deterministic: the same texts and vocab size give the same file.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from megatron.atomic_files import atomic_path
from megatron.errors import DataError, run_guarded

EOD_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str] | None = None,
              min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE trained on ``texts``; the first special token is the end-of-document token."""
    special = special_tokens or [EOD_TOKEN]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special):
        raise DataError(f"vocab size {vocab_size} is too small: the byte alphabet alone needs "
                        f"{len(alphabet) + len(special)} entries")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def iter_texts(paths: list[str], key: str) -> Iterator[str]:
    """Texts from jsonl (the ``key`` field) or plain-text files (one document per file)."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found")
        if not path.endswith((".jsonl", ".json")):
            yield Path(path).read_text(encoding="utf-8", errors="strict")
            continue
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[key]
                except (json.JSONDecodeError, TypeError, KeyError) as err:
                    raise DataError(f"{path}:{lineno}: expected a JSON object with a {key!r} string ({err})") from None
                if isinstance(text, str) and text.strip():
                    yield text


def portable_json(tok: Tokenizer) -> str:
    """``tok`` as a tokenizer.json that tokenizers 0.15.2 (GPT-NeoX's pin, via transformers 4.38) reads
    as well as current releases: BPE merges as ``"a b"`` strings. tokenizers >= 0.20 writes them as
    ``["a", "b"]`` pairs, which 0.15 cannot parse; both read the string form. A byte-level piece never
    holds a space (the byte alphabet maps it to ``Ġ``), so the string form is exact."""
    data = json.loads(tok.to_str(pretty=True))
    model = data.get("model") or {}
    merges = model.get("merges")
    if isinstance(merges, list):
        pairs = [m if isinstance(m, str) else list(m) for m in merges]
        if any(not isinstance(m, str) and any(" " in part for part in m) for m in pairs):
            raise DataError("a BPE merge contains a space, which tokenizer.json's string form cannot hold")
        model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in pairs]
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def save(tok: Tokenizer, path: str | os.PathLike[str]) -> None:
    """Write atomically so a crash never leaves a truncated tokenizer.json behind."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(portable_json(tok), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, nargs="+", help="jsonl files (or plain text files)")
    p.add_argument("--jsonl-key", default="text")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--output", required=True, help="where to write tokenizer.json")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    tok = train_bpe(iter_texts(args.input, args.jsonl_key), args.vocab_size, min_frequency=args.min_frequency)
    save(tok, args.output)
    print(f"wrote {args.output}: vocab {tok.get_vocab_size()}")
    return 0


def cli() -> None:
    """The ``deepy-train-tokenizer`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
