"""Tokenizers: one small class per kind behind :class:`Tokenizer`, each a ``tokenizer_type`` plug-in
(``registry.py``), built by :func:`build_tokenizer`."""

from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.config import padded_vocab_size
from megatron.tokenizer.build import build_tokenizer

__all__ = ["Tokenizer", "build_tokenizer", "padded_vocab_size"]
