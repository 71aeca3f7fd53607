"""UTF-8 bytes as tokens: no vocabulary file, useful for tests and tiny experiments."""

from __future__ import annotations

from megatron.tokenizer.base import Tokenizer


class CharLevelTokenizer(Tokenizer):
    """Token = byte value. Id 0 (NUL never occurs in text) is the end-of-document token."""

    name = "CharLevelTokenizer"

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 256:
            raise ValueError(f"CharLevelTokenizer needs vocab_size >= 256 to hold every byte, got {vocab_size}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return 0

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        # Ids above 255 (padding rows of the vocab) and the eod carry no text.
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")
