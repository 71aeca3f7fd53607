"""Tokenizers backed by HF ``tokenizers``, with the tiktoken fast path for byte-level BPE."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megatron.errors import DataError
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.config import TokenizerArgs
from megatron.tokenizer.fast_bpe import FastBPE, build_fast_encoder, verify

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
PAD_CANDIDATES = ("<|padding|>", "<pad>", "[PAD]")

log = logging.getLogger(__name__)


def _require_file(path: str | os.PathLike[str] | None, what: str, tokenizer_type: str) -> str:
    if not path:
        raise DataError(f"{tokenizer_type} needs {what} (set it in the config)")
    if not os.path.isfile(path):
        raise DataError(f"{path}: {what} for {tokenizer_type} not found")
    return os.fspath(path)


def load_hf_json(path: str | os.PathLike[str], tokenizer_type: str = "HFTokenizer") -> tokenizers.Tokenizer:
    """``Tokenizer.from_file`` with a DataError naming the file when it is not a tokenizer."""
    path = _require_file(path, "vocab_file (a tokenizer.json)", tokenizer_type)
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception with a serde message
        raise DataError(f"{path}: not a valid HF tokenizer.json ({err})") from None


class HFBackedTokenizer(Tokenizer):
    """Encodes with tiktoken when an equivalent encoder could be built and verified, else with HF."""

    name = "HFTokenizer"

    def __init__(self, hf: tokenizers.Tokenizer, fast: bool = True, split_special: bool = True) -> None:
        self._hf = hf
        self._fast: FastBPE | None = build_fast_encoder(hf, split_special=split_special) if fast else None
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eod = self._first_id(EOD_CANDIDATES)
        if eod is None:
            raise DataError(f"{self.name}: the vocabulary has no end-of-document token "
                            f"(looked for {', '.join(EOD_CANDIDATES)})")
        self._eod: int = eod
        pad = self._first_id(PAD_CANDIDATES)
        self._pad = self._eod if pad is None else pad

    def _first_id(self, candidates: tuple[str, ...]) -> int | None:
        for tok in candidates:
            tid = self._hf.token_to_id(tok)
            if tid is not None:
                return int(tid)
        return None

    @property
    def backend(self) -> str:
        return "tiktoken" if self._fast is not None else "hf"

    def verify_fast_path(self, texts: list[str]) -> bool:
        """Check the fast path on the caller's own data; on any difference switch to HF for good.

        Construction already checked a built-in sample; real corpora (other scripts, odd whitespace)
        are the better test, so preprocessing calls this on its first documents.
        """
        if self._fast is None or verify(self._fast, self._hf, texts):
            return True
        log.warning("%s: tiktoken fast path disagrees with HF tokenizers on this data; using HF", self.name)
        self._fast = None
        return False

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text)
        return self._hf.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return self._fast.encode_batch(texts, self.num_threads)
        return [e.ids for e in self._hf.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._hf.decode([int(i) for i in ids])


class HFTokenizer(HFBackedTokenizer):
    """A ``tokenizer.json`` file (``vocab_file``)."""

    name = "HFTokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str], fast: bool = True) -> None:
        super().__init__(load_hf_json(vocab_file, self.name), fast=fast)

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> HFTokenizer:
        return cls(str(config.vocab_file))


class HFGPT2Tokenizer(HFBackedTokenizer):
    """GPT-2's vocabulary from local files, with a ``<|padding|>`` token added as GPT-NeoX does.

    ``vocab_file`` is a tokenizer.json, a directory holding one, or a vocab.json with ``merge_file``.
    Nothing is downloaded: a training cluster may have no internet.
    """

    name = "HFGPT2Tokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str] | None,
                 merge_file: str | os.PathLike[str] | None = None, fast: bool = True) -> None:
        if not vocab_file:
            raise DataError("HFGPT2Tokenizer needs vocab_file: a local GPT-2 tokenizer.json or vocab.json "
                            "(with merge_file); downloading from the hub is not supported")
        path = Path(vocab_file)
        if path.is_dir():
            path = path / "tokenizer.json"
        if merge_file:
            hf = byte_level_bpe_from_files(vocab_file, merge_file, self.name)
            hf.add_special_tokens(["<|endoftext|>"])
        else:
            hf = load_hf_json(path, self.name)
        if hf.token_to_id("<|padding|>") is None:
            hf.add_special_tokens(["<|padding|>"])
        super().__init__(hf, fast=fast)

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> HFGPT2Tokenizer:
        return cls(config.vocab_file, config.merge_file)


def byte_level_bpe_from_files(vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str],
                              tokenizer_type: str) -> tokenizers.Tokenizer:
    """An HF tokenizer for GPT-2's original vocab.json + merges.txt pair."""
    vocab = _require_file(vocab_file, "vocab_file (vocab.json)", tokenizer_type)
    merges = _require_file(merge_file, "merge_file (merges.txt)", tokenizer_type)
    try:
        bpe = models.BPE.from_file(vocab, merges)
    except Exception as err:
        raise DataError(f"{vocab} / {merges}: not a GPT-2 vocab.json + merges.txt pair ({err})") from None
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    return hf


class GPT2BPETokenizer(HFBackedTokenizer):
    """GPT-2's vocab.json + merges.txt. Like the original encoder, special strings in text are plain text."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str],
                 fast: bool = True) -> None:
        super().__init__(byte_level_bpe_from_files(vocab_file, merge_file, self.name), fast=fast,
                         split_special=False)

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> GPT2BPETokenizer:
        return cls(str(config.vocab_file), str(config.merge_file))
