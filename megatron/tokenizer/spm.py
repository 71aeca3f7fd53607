"""SentencePiece models (``.model`` files)."""

from __future__ import annotations

import os

import sentencepiece

from megatron.errors import DataError
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.config import TokenizerArgs


class SPMTokenizer(Tokenizer):
    name = "SPMTokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str]) -> None:
        if not vocab_file or not os.path.isfile(vocab_file):
            raise DataError(f"{vocab_file}: SentencePiece model (vocab_file) not found")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=os.fspath(vocab_file))
        except Exception as err:
            raise DataError(f"{vocab_file}: not a SentencePiece model ({err})") from None
        # GPT-NeoX's convention: a dedicated <|endoftext|> piece wins over the model's </s>.
        eod = self._sp.piece_to_id("<|endoftext|>")
        if eod == self._sp.unk_id() or eod < 0:
            eod = self._sp.eos_id()
        if eod < 0:
            raise DataError(f"{vocab_file}: the SentencePiece model has no <|endoftext|> or eos piece")
        self._eod = int(eod)
        pad = self._sp.pad_id()
        self._pad = int(pad) if pad >= 0 else self._eod

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> SPMTokenizer:
        return cls(str(config.vocab_file))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode(texts, num_threads=self.num_threads)]

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])
