#!/usr/bin/env python
"""Concatenate MMIDIDX datasets into one: sequences and document boundaries are kept, in order.

``--input`` takes dataset prefixes (``path/name`` for ``path/name.{bin,idx}``) and/or directories, which
stand for every dataset inside them in sorted order. All inputs must store the same token dtype.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.errors import DataError, run_guarded


def resolve_prefixes(items: list[str]) -> list[str]:
    prefixes: list[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(str(p.with_suffix("")) for p in Path(item).glob("*.idx"))
            if not found:
                raise DataError(f"{item}: directory holds no .idx files")
            prefixes.extend(found)
        else:
            prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
            if not os.path.exists(index_file_path(prefix)):
                raise DataError(f"{index_file_path(prefix)}: dataset index not found")
            prefixes.append(prefix)
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> MMapIndexedDataset:
    if not prefixes:
        raise DataError("no datasets to merge")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise DataError(f"{output_prefix}: the output would overwrite one of the inputs")
    first = MMapIndexedDataset(prefixes[0])  # opens and validates; its dtype is the merged dtype
    builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix), first.dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    return MMapIndexedDataset(output_prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes and/or directories, in order")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    prefixes = resolve_prefixes(args.input)
    merged = merge(prefixes, args.output_prefix)
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {len(merged.doc_idx) - 1:,} documents, "
          f"{len(merged):,} sequences, {merged.num_tokens:,} tokens")
    return 0


def cli() -> None:
    """The ``deepy-merge-datasets`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
