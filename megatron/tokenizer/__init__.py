"""Tokenizers: one small class per kind behind :class:`Tokenizer`, built by :func:`build_tokenizer`."""

from megatron.tokenizer.base import Tokenizer, padded_vocab_size
from megatron.tokenizer.build import TOKENIZERS, build_tokenizer

__all__ = ["TOKENIZERS", "Tokenizer", "build_tokenizer", "padded_vocab_size"]
