"""tiktoken encodings, by name (``cl100k_base``...) or from a ``.tiktoken`` ranks file."""

from __future__ import annotations

import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from megatron.errors import DataError
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.config import TokenizerArgs
from megatron.tokenizer.fast_bpe import GPT2_SPLIT_PATTERN, FastBPE

EOD = "<|endoftext|>"


class TiktokenTokenizer(Tokenizer):
    """``vocab_file`` is an encoding name or a ranks file (base64 token, rank per line).

    A ranks file uses GPT-2's split pattern; ``<|endoftext|>`` gets the id after the last rank.
    """

    name = "TiktokenTokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str] | None) -> None:
        if not vocab_file:
            raise DataError("TiktokenTokenizer needs vocab_file: an encoding name (e.g. cl100k_base) "
                            "or a .tiktoken ranks file")
        source = os.fspath(vocab_file)
        if os.path.isfile(source):
            try:
                ranks = load_tiktoken_bpe(source)
            except Exception as err:
                raise DataError(f"{source}: not a tiktoken ranks file ({err})") from None
            name = os.path.basename(source)
            enc = tiktoken.Encoding(name=name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
                                    special_tokens={EOD: max(ranks.values()) + 1})
        else:
            try:
                enc = tiktoken.get_encoding(source)
            except Exception as err:  # unknown name, or its files cannot be fetched offline
                raise DataError(f"tiktoken encoding {source!r} is not available ({err}); "
                                "pass a local .tiktoken file as vocab_file instead") from None
        if EOD not in enc.special_tokens_set:
            raise DataError(f"tiktoken encoding {source!r} has no {EOD} token to end documents")
        self._enc = enc
        self._fast = FastBPE(enc, split_special=True)

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> TiktokenTokenizer:
        return cls(config.vocab_file)

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    @property
    def eod(self) -> int:
        return int(self._enc.eot_token)

    @property
    def backend(self) -> str:
        return "tiktoken"

    def tokenize(self, text: str) -> list[int]:
        return self._fast.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._fast.encode_batch(texts, self.num_threads)

    def detokenize(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids])
