"""Argument names as users write them: ``-``/``_`` spellings and "did you mean" suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def _singular_aliases() -> dict[str, str]:
    from megatron.data.config import PATH_KEYS

    return {key.removesuffix("s"): key for key in PATH_KEYS}


SINGULAR_ALIASES: dict[str, str] = _singular_aliases()
"""GPT-NeoX's configuration guide writes the per-split data keys in the singular
(``train_data_path``, ``pos_valid_label_data_path``) while its argument list has the plural lists;
the singular spelling is a one-path form of the plural key."""


def normalize_key(key: str) -> str:
    """GPT-NeoX configs write ``train-iters`` and ``train_iters`` alike; both mean the same argument,
    and a singular data key (``train_data_path``) means its plural list (``train_data_paths``)."""
    key = key.replace("-", "_")
    return SINGULAR_ALIASES.get(key, key)


def aliased_value(raw_key: str, value: object) -> object:
    """The value a key written as ``raw_key`` stands for: one path becomes a one-item list when the
    key is a singular alias of a list key."""
    if raw_key.replace("-", "_") in SINGULAR_ALIASES and isinstance(value, str):
        return [value]
    return value


def close_matches(key: str, names: Iterable[str], limit: int = 3) -> list[str]:
    return difflib.get_close_matches(normalize_key(key), list(names), n=limit, cutoff=0.6)


def unknown_key_message(key: str, where: str, names: Iterable[str]) -> str:
    """``unknown key 'hiden_size' at configs/x.yml:3; did you mean: hidden_size?``"""
    matches = close_matches(key, names)
    hint = f"; did you mean: {', '.join(matches)}?" if matches else "; see configs/neox_arguments.md for the valid keys"
    return f"unknown key '{key}' at {where}{hint}"
