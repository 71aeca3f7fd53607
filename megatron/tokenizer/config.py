"""Tokenizer choice, its files and the padded vocabulary size computed from it. GPT-NeoX files the
tokenizer files (``vocab_file``, ``merge_file``) under ``NeoXArgsTraining`` and the padding
(``make_vocab_size_divisible_by``) under ``NeoXArgsModel``.

Declared here, beside the tokenizers that read them; the one argument object (``NeoXArgs``) is
composed of this class, and the trainer hands :func:`megatron.tokenizer.build_tokenizer` that object
(typed as :class:`TokenizerArgs`). The accepted ``tokenizer_type`` values are the registered
tokenizer plug-ins (``registry.py``), whose own keys join the arguments object like any plug-in's.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.tokenizer import registry as _registry  # noqa: F401  # declares the accepted tokenizer_type values


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      model_parallel_size: int = 1) -> int:
    """Round the vocabulary up so the embedding splits evenly over tensor-parallel ranks.

    Each rank holds ``padded / tp`` rows, and a multiple of 128 keeps those matmuls aligned.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    multiple = max(1, make_vocab_size_divisible_by) * max(1, model_parallel_size)
    return -(-vocab_size // multiple) * multiple


class TokenizerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTokenizer`` group, with the tokenizer files (``NeoXArgsTraining``) and the
    vocabulary padding (``NeoXArgsModel``) that only the tokenizer reads."""

    tokenizer_type: str = "GPT2BPETokenizer"
    """Which tokenizer reads vocab_file (and merge_file for GPT-2 BPE), a registered tokenizer plug-in
    (``megatron/tokenizer/registry.py``): GPT-NeoX's names, or a user's from ``plugins``."""

    @field_validator("tokenizer_type")
    @classmethod
    def _registered_tokenizer(cls, value: str) -> str:
        return plugins.validate_name("tokenizer_type", value)

    vocab_file: str | None = None
    """Tokenizer file (tokenizer.json, vocab.json or a SentencePiece model)."""

    merge_file: str | None = None
    """BPE merges file for the GPT-2 tokenizer."""

    make_vocab_size_divisible_by: int = Field(128, ge=1)
    """Pad the embedding rows up to a multiple of this (times the tensor-parallel size) so matrix
    shapes stay efficient."""

    def padded(self, vocab_size: int, tensor_parallel: int) -> int:
        """Rows of the embedding for a tokenizer of ``vocab_size`` entries whose embedding is split over
        ``tensor_parallel`` ranks (so the padded size divides by it). A config's own
        ``padded_vocab_size`` (a model key) wins over this: ``GPTConfig.for_tokenizer``."""
        return padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by, tensor_parallel)
