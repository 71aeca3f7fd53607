"""Attention types a GPT-NeoX ``attention_config`` may name, and which of them Deepy refuses (as obsolete,
by the support check in ``arguments.py``). Fields supported except for a few values are marked with
:func:`megatron.config_schema.partly_supported`; the libraries that run only on an NVIDIA GPU are named in
``config_schema`` (:data:`~megatron.config_schema.TRANSFORMER_ENGINE`).
"""

from __future__ import annotations

_SPARSE_GONE = ("DeepSpeed's block-sparse attention (deepspeed.ops.sparse_attention, which GPT-NeoX ea7aefd8 "
                "megatron/model/utils.py configure_sparse_attention imports) is gone from DeepSpeed 0.19.8 "
                "(no ops/sparse_attention; runtime/config.py: \"DeepSpeed Sparse Attention has been removed\"): "
                "use global or flash attention, or local (sliding_window_width) for a banded pattern")
_RING_NEVER_MERGED = ("ring attention was only on GPT-NeoX's unmerged add-context-parallel-support branch "
                      "(609fe679, 4969683e, 2024); GPT-NeoX ea7aefd8's ATTENTION_TYPE_CHOICES has no ring: "
                      "use global or flash attention with context_parallel_size for long sequences")

OBSOLETE_ATTENTION_TYPES: dict[str, str] = {
    "sparse_fixed": _SPARSE_GONE,
    "sparse_variable": _SPARSE_GONE,
    "bigbird": _SPARSE_GONE,
    "bslongformer": _SPARSE_GONE,
    "ring": _RING_NEVER_MERGED,
}
"""Attention types refused with why and what to use instead. "global", "local" (sliding window) and "flash"
(an implementation of global attention) are built, and so are the other layer families GPT-NeoX builds from
this list: "mamba", "rwkv", "gmlp", "amlp" (megatron/model/family_config.py)."""

SPARSE_ATTENTION_GONE = _SPARSE_GONE
"""Why ``sparsity_config`` (the settings of those kernels) is obsolete."""

# Attention types a GPT-NeoX attention_config may name that Deepy's model does not build.
UNSUPPORTED_ATTENTION_TYPES: frozenset[str] = frozenset(OBSOLETE_ATTENTION_TYPES)
KNOWN_ATTENTION_TYPES: frozenset[str] = UNSUPPORTED_ATTENTION_TYPES | {"global", "local", "flash", "mamba", "rwkv",
                                                                      "gmlp", "amlp"}
