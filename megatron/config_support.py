"""Attention types a GPT-NeoX ``attention_config`` may name, and which of them Deepy does not build
(refused as "not supported yet" by the support check in ``arguments.py``). Fields supported except
for a few values are marked with :func:`megatron.config_schema.partly_supported`.
"""

from __future__ import annotations

# Attention types a GPT-NeoX attention_config may name that Deepy's model does not build. "global",
# "local" (sliding window) and "flash" (an implementation of global attention) are supported, and so are
# the other layer families GPT-NeoX builds from this list: "mamba", "rwkv", "gmlp", "amlp"
# (megatron/model/family_config.py).
UNSUPPORTED_ATTENTION_TYPES: frozenset[str] = frozenset(
    {
        "sparse_fixed",
        "sparse_variable",
        "bigbird",
        "bslongformer",
        "ring",
    }
)
KNOWN_ATTENTION_TYPES: frozenset[str] = UNSUPPORTED_ATTENTION_TYPES | {"global", "local", "flash", "mamba", "rwkv",
                                                                      "gmlp", "amlp"}
