#!/usr/bin/env python
"""Build a training dataset. With no name (or ``pydocs``) this builds the embedded default corpus.

``pydocs`` is text that ships with every Python: the docstrings of the standard library's modules,
classes and functions, and the reference topics of ``pydoc_data``. So a fresh checkout can train
without downloading anything. Output, under ``--data-dir`` (default ``data``)::

    pydocs/pydocs.jsonl                          one {"text": ...} per docstring / topic
    pydocs/tokenizer.json                        byte-level BPE trained on it (vocab 8192)
    pydocs/pydocs_text_document.{bin,idx}        the tokenized MMIDIDX dataset

These are the paths ``configs/local_setup.yml`` points at. The build is deterministic on a given
Python: modules are visited in sorted order, duplicate texts dropped by first occurrence, and the
tokenizer trainer has no randomness.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# megatron and tools are found beside this file (Python puts its folder first on sys.path)
from megatron.atomic_files import atomic_path
from megatron.errors import UsageError, run_guarded

DATASETS = ("pydocs",)
MIN_DOC_CHARS = 64

# Modules that act when imported (open a browser, print, start a GUI or test run), only exist on
# other platforms, or differ between machines (distutils is shimmed by setuptools).
UNSAFE_MODULES = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
    "distutils", "readline", "rlcompleter", "pydoc_data", "msilib", "winreg", "winsound", "nt", "msvcrt",
    "__phello__", "xxlimited", "xxlimited_35", "xxsubtype",
})


def _is_safe(name: str, include_private: bool = False) -> bool:
    parts = name.split(".")
    if parts[0] in UNSAFE_MODULES or "__main__" in parts:  # __main__ runs a program when imported
        return False
    if not include_private and any(p.startswith("_") for p in parts):
        return False
    return not any(p in ("test", "tests", "idle_test") for p in parts)


def _quiet_import(name: str):  # noqa: ANN202 - a module or None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # ImportError, platform errors, SystemExit from odd modules
            return None


def stdlib_modules(include_private: bool = False) -> Iterator[object]:
    """Importable standard-library modules (packages walked), in sorted name order."""
    for top in sorted(sys.stdlib_module_names):
        if not _is_safe(top, include_private):
            continue
        module = _quiet_import(top)
        if module is None:
            continue
        yield module
        path = getattr(module, "__path__", None)
        if not path:
            continue
        subs = sorted(info.name for info in pkgutil.iter_modules(path, prefix=top + "."))
        # Two levels are enough for the stdlib (email.mime.text, concurrent.futures.thread).
        for sub in subs:
            if not _is_safe(sub, include_private):
                continue
            submodule = _quiet_import(sub)
            if submodule is None:
                continue
            yield submodule
            for subsub in sorted(i.name for i in pkgutil.iter_modules(getattr(submodule, "__path__", []) or [],
                                                                     prefix=sub + ".")):
                if _is_safe(subsub, include_private) and (m := _quiet_import(subsub)) is not None:
                    yield m


def _docstrings_of(module: object, include_private: bool = False) -> Iterator[str]:
    name = getattr(module, "__name__", "")
    if doc := inspect.getdoc(module):
        yield doc
    for attr, obj in sorted(vars(module).items()):
        if (attr.startswith("_") and not include_private) or getattr(obj, "__module__", None) != name:
            continue  # re-exports are documented where they are defined
        if inspect.isclass(obj):
            if doc := inspect.getdoc(obj):
                yield doc
            for member_name, member in sorted(vars(obj).items()):
                if member_name.startswith("_") and not include_private:
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property) or inspect.ismethoddescriptor(member):
                    if (doc := member.__doc__) and isinstance(doc, str):
                        yield inspect.cleandoc(doc)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            if doc := inspect.getdoc(obj):
                yield doc


def stdlib_docstrings(min_chars: int = MIN_DOC_CHARS, include_private: bool = False) -> list[str]:
    """Distinct docstrings of at least ``min_chars`` characters, first occurrence order.

    ``include_private`` adds private modules and members (more text, for benchmarks); the default
    corpus keeps to the public API.
    """
    seen: set[str] = set()
    out: list[str] = []
    for module in stdlib_modules(include_private):
        for doc in _docstrings_of(module, include_private):
            doc = doc.strip()
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return out


def pydoc_topics() -> list[str]:
    """The language reference sections that ``help('topic')`` shows."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def write_jsonl(texts: list[str], path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def build_pydocs(data_dir: Path, vocab_size: int, max_docs: int | None, workers: int) -> Path:
    from tools.datasets import preprocess_data, train_tokenizer

    out = data_dir / "pydocs"
    texts = pydoc_topics() + stdlib_docstrings()
    if max_docs is not None:
        texts = texts[:max_docs]
    jsonl = out / "pydocs.jsonl"
    write_jsonl(texts, jsonl)
    print(f"wrote {jsonl}: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f}M characters")

    tok_path = out / "tokenizer.json"
    tokenizer = train_tokenizer.train_bpe(texts, vocab_size)
    train_tokenizer.save(tokenizer, tok_path)
    print(f"wrote {tok_path}: vocab {tokenizer.get_vocab_size()}")

    args = preprocess_data.parse_args(["--input", str(jsonl), "--output-prefix", str(out / "pydocs"),
                                       "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tok_path),
                                       "--append-eod", "--workers", str(workers), "--quiet"])
    preprocess_data.report(preprocess_data.preprocess(args))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", nargs="?", default="pydocs", help=f"dataset to build: {', '.join(DATASETS)}")
    p.add_argument("-d", "--data-dir", default="data", help="parent directory of the dataset folder")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-docs", type=int, default=None, help="keep only the first N documents (quick tests)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    if args.dataset not in DATASETS:
        raise UsageError(f"unknown dataset {args.dataset!r}: this offline build knows {', '.join(DATASETS)}; "
                         "for your own data run tools/datasets/preprocess_data.py on jsonl files")
    if args.max_docs is not None and args.max_docs < 1:
        raise UsageError(f"--max-docs must be at least 1, got {args.max_docs}")
    build_pydocs(Path(args.data_dir), args.vocab_size, args.max_docs, args.workers)
    return 0


if __name__ == "__main__":
    run_guarded(main)
