"""Argument names as users write them: ``-``/``_`` spellings and "did you mean" suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def normalize_key(key: str) -> str:
    """GPT-NeoX configs write ``train-iters`` and ``train_iters`` alike; both mean the same argument."""
    return key.replace("-", "_")


def close_matches(key: str, names: Iterable[str], limit: int = 3) -> list[str]:
    return difflib.get_close_matches(normalize_key(key), list(names), n=limit, cutoff=0.6)


def unknown_key_message(key: str, where: str, names: Iterable[str]) -> str:
    """``unknown key 'hiden_size' at configs/x.yml:3; did you mean: hidden_size?``"""
    matches = close_matches(key, names)
    hint = f"; did you mean: {', '.join(matches)}?" if matches else "; see configs/neox_arguments.md for the valid keys"
    return f"unknown key '{key}' at {where}{hint}"
