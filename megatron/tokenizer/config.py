"""The typed view of the tokenizer keys: which tokenizer reads which files, and how the vocabulary
is padded for the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.tokenizer.base import padded_vocab_size

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    type: str = "GPT2BPETokenizer"
    """``tokenizer_type``: a name in ``megatron.tokenizer.build.TOKENIZERS``."""
    vocab_file: str | None = None
    merge_file: str | None = None
    make_vocab_size_divisible_by: int = 128
    tensor_parallel: int = 1
    """The embedding rows are split over this many ranks, so the padded vocabulary divides by it."""
    padded_vocab_size: int | None = None
    """An explicit padded size from the config; None = computed from the tokenizer."""

    def padded(self, vocab_size: int) -> int:
        """Rows of the embedding for a tokenizer of ``vocab_size`` entries."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        return padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by, self.tensor_parallel)

    @classmethod
    def from_args(cls, args: NeoXArgs) -> TokenizerConfig:
        return cls(
            type=args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            tensor_parallel=args.model_parallel_size,
            padded_vocab_size=args.padded_vocab_size,
        )
