#!/usr/bin/env python
"""Build a small preference set from the built-in corpus, ready for DPO, reward models or KTO.

Each pair comes from one documentation text of ``data/pydocs/pydocs.jsonl`` (``python prepare_data.py``
builds it): the prompt is its first words, the *chosen* completion the words that really follow them, the
*rejected* completion the same words in a shuffled order (``--rejected shuffled``, the default: fluent
text over word salad, a preference a tiny model learns and carries to held-out pairs) or words from
another, randomly drawn document (``--rejected other-document``: reads fine on its own but does not
belong to the prompt; too subtle for the tiny model). The documents are split into train and valid
before pairing, so held-out pairs use held-out text only. Deterministic for a given ``--seed``.

Writes ``<out>/{train,valid}.jsonl`` (``prompt``/``chosen``/``rejected``, and for KTO one ``completion``
with a boolean ``reward`` per row) and tokenizes them with ``preprocess_data_with_mask.py`` into::

    <out>/{train,valid}_{chosen,rejected}_document, ..._{chosen,rejected}_label_document   (--format pairwise)
    <out>/{train,valid}_{text,label,reward}_document                                        (--format reward)

It also writes ``<out>/dpo.yml`` (pairwise) or ``<out>/kto.yml`` (reward): a config overlay naming these
datasets and the objective, to put after the model and setup configs (README: Post-training).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron.atomic_files import atomic_path
from megatron.errors import DataError, UsageError, run_guarded


def read_texts(path: Path, min_words: int) -> list[list[str]]:
    if not path.is_file():
        raise DataError(f"{path} not found: build the built-in corpus first with `python prepare_data.py`")
    texts = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            try:
                words = str(json.loads(line)["text"]).split()
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{line_no}: not a {{\"text\": ...}} JSON line ({err})") from None
            if len(words) >= min_words:
                texts.append(words)
    return texts


def make_pairs(texts: list[list[str]], prompt_words: int, completion_words: int, seed: int,
               rejected: str = "other-document") -> list[dict[str, str]]:
    """One pair per text: its own continuation (chosen) against a worse one (rejected): another text's
    words (``other-document``) or the same words in a shuffled order (``shuffled``)."""
    rng = random.Random(seed)
    pairs = []
    for i, words in enumerate(texts):
        chosen = words[prompt_words : prompt_words + completion_words]
        if rejected == "shuffled":
            worse = chosen[:]
            while worse == chosen and len(set(chosen)) > 1:
                rng.shuffle(worse)
        else:
            j = rng.randrange(len(texts) - 1)
            j += j >= i  # any text but this one
            other = texts[j]
            start = rng.randrange(max(1, len(other) - completion_words))
            worse = other[start : start + completion_words]
        pairs.append({"prompt": " ".join(words[:prompt_words]) + " ", "chosen": " ".join(chosen),
                      "rejected": " ".join(worse)})
    return pairs


def as_kto(pairs: list[dict[str, str]]) -> list[dict[str, object]]:
    """KTO reads single completions: each pair gives one desirable and one undesirable row."""
    rows: list[dict[str, object]] = []
    for pair in pairs:
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "reward": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "reward": False})
    return rows


def write_jsonl(rows: Sequence[Mapping[str, object]], path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def overlay(out: Path, fmt: str) -> str:
    """The config keys that point a run at the written datasets (YAML text)."""
    lines = ["# written by tools/datasets/build_preference_data.py: the objective and its data",
             f"train_impl: {'dpo' if fmt == 'pairwise' else 'kto'}", "pack_impl: unpacked"]
    for split in ("train", "valid"):
        base = out / split
        if fmt == "pairwise":
            lines += [f"pos_{split}_data_paths: [{base}_chosen_document]",
                      f"neg_{split}_data_paths: [{base}_rejected_document]",
                      f"pos_{split}_label_data_paths: [{base}_chosen_label_document]",
                      f"neg_{split}_label_data_paths: [{base}_rejected_label_document]"]
        else:
            lines += [f"{split}_data_paths: [{base}_text_document]",
                      f"{split}_label_data_paths: [{base}_label_document]",
                      f"{split}_reward_data_paths: [{base}_reward_document]"]
    if fmt == "pairwise":
        lines.insert(2, "dataset_impl: pairwise")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from tools.datasets import preprocess_data_with_mask as masked

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default="data/pydocs/pydocs.jsonl")
    p.add_argument("--output-dir", default="data/pydocs_pref")
    p.add_argument("--format", choices=["pairwise", "reward"], default="pairwise",
                   help="pairwise: DPO and reward models; reward: KTO (one row per completion)")
    p.add_argument("--tokenizer-type", default="HFTokenizer")
    p.add_argument("--vocab-file", default="data/pydocs/tokenizer.json")
    p.add_argument("--prompt-words", type=int, default=12)
    p.add_argument("--completion-words", type=int, default=12)
    p.add_argument("--rejected", choices=["shuffled", "other-document"], default="shuffled",
                   help="the rejected completion: the chosen words shuffled (a preference a tiny model learns and "
                        "carries to held-out pairs), or words from another document")
    p.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--max-pairs", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.valid_fraction < 1:
        raise UsageError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    texts = read_texts(Path(args.input), args.prompt_words + args.completion_words)
    if len(texts) < 4:
        raise DataError(f"{args.input}: only {len(texts)} texts have {args.prompt_words + args.completion_words} "
                        "words or more; lower --prompt-words/--completion-words")
    texts = texts[: args.max_pairs]
    n_valid = max(2, int(len(texts) * args.valid_fraction))
    # Split the documents before pairing: a held-out pair's rejected text then comes from a held-out
    # document too. Drawn from a training document, it is text the policy was just trained to like
    # (its own pair's chosen continuation, or nearby), and held-out accuracy measured memorisation
    # instead of preference (0.225 on the README recipe, below chance).
    splits = {"train": make_pairs(texts[n_valid:], args.prompt_words, args.completion_words, args.seed, args.rejected),
              "valid": make_pairs(texts[:n_valid], args.prompt_words, args.completion_words, args.seed + 1,
                                args.rejected)}
    pairs = splits["train"] + splits["valid"]
    out = Path(args.output_dir)
    for split, rows in splits.items():
        records: Sequence[Mapping[str, object]] = rows if args.format == "pairwise" else as_kto(rows)
        jsonl = out / f"{split}.jsonl"
        write_jsonl(records, jsonl)
        masked.main(["--input", str(jsonl), "--output-prefix", str(out / split), "--mode", args.format,
                     "--tokenizer-type", args.tokenizer_type, "--vocab-file", args.vocab_file, "--append-eod"])
    config = out / ("dpo.yml" if args.format == "pairwise" else "kto.yml")
    with atomic_path(config) as tmp:
        tmp.write_text(overlay(out, args.format), encoding="utf-8")
    print(f"{len(pairs) - n_valid} train / {n_valid} valid pairs (documents split before pairing); "
          f"config overlay: {config}")
    return 0


def cli() -> None:
    """The ``deepy-build-preference-data`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
