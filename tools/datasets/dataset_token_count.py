#!/usr/bin/env python
"""Count documents, sequences and tokens in MMIDIDX datasets (read from the index only)."""

from __future__ import annotations

import argparse
import json

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import run_guarded


def count(prefix: str) -> dict[str, int | str]:
    """Documents, sequences and tokens of one dataset; only the ``.idx`` is read, not the tokens."""
    ds = MMapIndexedDataset(prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix)
    return {"prefix": ds.prefix, "documents": max(0, len(ds.doc_idx) - 1), "sequences": len(ds),
            "tokens": int(np.asarray(ds.sizes).sum(dtype=np.int64)), "dtype": np.dtype(ds.dtype).name}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("datasets", nargs="+", help="dataset prefixes (path/name for path/name.{bin,idx})")
    p.add_argument("--json", action="store_true", help="one JSON object per dataset, then the total")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    rows = [count(prefix) for prefix in args.datasets]
    total: dict[str, int | str] = {"prefix": "total", **{k: sum(int(r[k]) for r in rows) for k in ("documents", "sequences", "tokens")}}
    if args.json:
        for row in [*rows, total]:
            print(json.dumps(row))
        return 0
    width = max(len(str(row["prefix"])) for row in [*rows, total])
    print(f"{'dataset':<{width}}  {'documents':>12}  {'sequences':>12}  {'tokens':>15}")
    for r in [*rows, total] if len(rows) > 1 else rows:
        print(f"{r['prefix']:<{width}}  {r['documents']:>12,}  {r['sequences']:>12,}  {r['tokens']:>15,}")
    return 0


def cli() -> None:
    """The ``deepy-dataset-token-count`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
