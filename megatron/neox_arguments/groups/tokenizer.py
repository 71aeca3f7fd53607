"""Tokenizer choice and the padded vocabulary size computed from it.

The tokenizer file itself is ``vocab_file`` in the training group, where GPT-NeoX keeps it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup

TokenizerType = Literal[
    "GPT2BPETokenizer",
    "HFTokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
]


class TokenizerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTokenizer`` group."""

    tokenizer_type: TokenizerType = "GPT2BPETokenizer"
    """Which tokenizer class reads vocab_file (and merge_file for GPT-2 BPE)."""

    padded_vocab_size: int | None = Field(None, ge=1)
    """Vocabulary size after padding for make_vocab_size_divisible_by; computed at runtime."""
