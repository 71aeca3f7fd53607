"""``build_tokenizer(config)``: the tokenizer named by ``config.tokenizer_type``, from a registry."""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron.errors import ConfigError
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.char_level import CharLevelTokenizer
from megatron.tokenizer.config import TokenizerArgs
from megatron.tokenizer.hf import GPT2BPETokenizer, HFGPT2Tokenizer, HFTokenizer
from megatron.tokenizer.spm import SPMTokenizer
from megatron.tokenizer.tiktoken_tokenizer import TiktokenTokenizer

log = logging.getLogger(__name__)

Factory = Callable[[TokenizerArgs], Tokenizer]


def _needs(config: TokenizerArgs, key: str) -> str:
    value = config.vocab_file if key == "vocab_file" else config.merge_file
    if not value:
        raise ConfigError(f"tokenizer_type={config.tokenizer_type} needs {key}: set it to the tokenizer's file")
    return value


TOKENIZERS: dict[str, Factory] = {
    "HFTokenizer": lambda c: HFTokenizer(_needs(c, "vocab_file")),
    "HFGPT2Tokenizer": lambda c: HFGPT2Tokenizer(c.vocab_file, c.merge_file),
    "GPT2BPETokenizer": lambda c: GPT2BPETokenizer(_needs(c, "vocab_file"), _needs(c, "merge_file")),
    "SPMTokenizer": lambda c: SPMTokenizer(_needs(c, "vocab_file")),
    "CharLevelTokenizer": lambda c: CharLevelTokenizer(),
    "TiktokenTokenizer": lambda c: TiktokenTokenizer(_needs(c, "vocab_file")),
}


def build_tokenizer(config: TokenizerArgs) -> Tokenizer:
    """The tokenizer ``config.tokenizer_type`` names, reading ``config.vocab_file``/``merge_file``."""
    factory = TOKENIZERS.get(config.tokenizer_type)
    if factory is None:
        raise ConfigError(f"tokenizer_type: unknown value {config.tokenizer_type!r}; choose one of {', '.join(sorted(TOKENIZERS))}")
    tokenizer = factory(config)
    log.info("tokenizer %s (%s backend): vocab %d", config.tokenizer_type, tokenizer.backend, tokenizer.vocab_size)
    return tokenizer
