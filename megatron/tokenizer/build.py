"""``build_tokenizer(args)``: the tokenizer named by ``args.tokenizer_type``, from a registry."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from megatron.errors import ConfigError
from megatron.tokenizer.base import Tokenizer, padded_vocab_size
from megatron.tokenizer.char_level import CharLevelTokenizer
from megatron.tokenizer.hf import GPT2BPETokenizer, HFGPT2Tokenizer, HFTokenizer
from megatron.tokenizer.spm import SPMTokenizer
from megatron.tokenizer.tiktoken_tokenizer import TiktokenTokenizer

log = logging.getLogger(__name__)

Factory = Callable[[Any], Tokenizer]

TOKENIZERS: dict[str, Factory] = {
    "HFTokenizer": lambda a: HFTokenizer(a.vocab_file),
    "HFGPT2Tokenizer": lambda a: HFGPT2Tokenizer(a.vocab_file, getattr(a, "merge_file", None)),
    "GPT2BPETokenizer": lambda a: GPT2BPETokenizer(a.vocab_file, a.merge_file),
    "SPMTokenizer": lambda a: SPMTokenizer(a.vocab_file),
    "CharLevelTokenizer": lambda a: CharLevelTokenizer(),
    "TiktokenTokenizer": lambda a: TiktokenTokenizer(a.vocab_file),
}


def register_tokenizer(name: str, factory: Factory) -> None:
    """Add a tokenizer type; ``factory`` receives the args object."""
    TOKENIZERS[name] = factory


def build_tokenizer(args: Any) -> Tokenizer:
    """Build ``args.tokenizer_type`` and record ``args.padded_vocab_size`` when args accepts it."""
    kind = getattr(args, "tokenizer_type", None)
    factory = TOKENIZERS.get(str(kind))
    if factory is None:
        raise ConfigError(f"tokenizer_type: unknown value {kind!r}; choose one of {', '.join(sorted(TOKENIZERS))}")
    for key in ("vocab_file", "merge_file"):
        if not hasattr(args, key):
            try:
                setattr(args, key, None)
            except Exception:  # a frozen object; the factory reads it with getattr where optional
                pass
    tokenizer = factory(args)
    padded = padded_vocab_size(tokenizer.vocab_size, int(getattr(args, "make_vocab_size_divisible_by", 128) or 1),
                               int(getattr(args, "model_parallel_size", 1) or 1))
    try:
        args.padded_vocab_size = padded
    except Exception:  # plain namespaces without the field are fine; the caller can compute it
        pass
    log.info("tokenizer %s (%s backend): vocab %d, padded to %d", kind, tokenizer.backend,
             tokenizer.vocab_size, padded)
    return tokenizer
