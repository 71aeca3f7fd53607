"""The one interface every tokenizer implements, and vocabulary padding."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Protocol


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      model_parallel_size: int = 1) -> int:
    """Round the vocabulary up so the embedding splits evenly over tensor-parallel ranks.

    Each rank holds ``padded / tp`` rows, and a multiple of 128 keeps those matmuls aligned.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    multiple = max(1, make_vocab_size_divisible_by) * max(1, model_parallel_size)
    return -(-vocab_size // multiple) * multiple


def default_num_threads() -> int:
    """Threads for batch encoding: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class TokenizerFiles(Protocol):
    """The file keys Deepy's tokenizers read (declared by ``TokenizerArgs``, ``megatron/tokenizer/config.py``)."""

    @property
    def vocab_file(self) -> str | None: ...
    @property
    def merge_file(self) -> str | None: ...


class Tokenizer(ABC):
    """Text <-> token ids. ``eod`` ends a document; ``pad`` fills batches (eod if the vocab has none).

    Each kind is a ``tokenizer_type`` plug-in (``registry.py``; a user's registers with
    ``megatron.plugins.register("tokenizer_type", name, keys=..., requires=...)``), built from the
    config by :meth:`from_config`."""

    name: str = "tokenizer"
    #: threads used by :meth:`tokenize_batch` where the backend can use several
    num_threads: int = default_num_threads()

    @classmethod
    def from_config(cls, config: TokenizerFiles) -> Tokenizer:
        """The tokenizer the config's keys describe: ``config`` is the arguments object, so a plug-in
        reads its own keys from it too. The keys its registry entry ``requires`` are already set."""
        return cls()  # a concrete subclass reading no key

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int: ...

    @property
    def pad(self) -> int:
        return self.eod

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    @property
    def backend(self) -> str:
        """Which engine encodes (for logs and benchmarks)."""
        return self.name
