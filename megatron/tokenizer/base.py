"""The one interface every tokenizer implements."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.tokenizer.config import TokenizerArgs


def default_num_threads() -> int:
    """Threads for batch encoding: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Tokenizer(ABC):
    """Text <-> token ids. ``eod`` ends a document; ``pad`` fills batches (eod if the vocab has none).

    Each kind is a ``tokenizer_type`` plug-in (``registry.py``; a user's registers with
    ``megatron.plugins.register("tokenizer_type", name, keys=..., requires=...)``), built from the
    config by :meth:`from_config`."""

    name: str = "tokenizer"
    #: threads used by :meth:`tokenize_batch` where the backend can use several
    num_threads: int = default_num_threads()

    @classmethod
    def from_config(cls, config: TokenizerArgs) -> Tokenizer:
        """The tokenizer the config's keys describe (``vocab_file``, ``merge_file``: :class:`TokenizerArgs`):
        ``config`` is the arguments object, so a plug-in reads its own keys from it too. The keys its
        registry entry ``requires`` are already set."""
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
