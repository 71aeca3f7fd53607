"""Which parameters are split across tensor-parallel ranks, and how (for checkpoint resharding).

Patterns are regexes for `re.match` (they are anchored) on a parameter's name; they match `GPTModel` names
(`layers.3.attention.dense.weight`) and pipeline layer names (`4.attention.dense.weight`) alike.
A parameter that matches no pattern is replicated on every tp rank (an RWKV layer's, all of them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron.model.activations import get_activation
from megatron.model.config import GPTConfig
from megatron.model.family_config import mamba_shape


@dataclass(frozen=True)
class TPPartition:
    """Split along `dim`; `sections` (full sizes along `dim`) for fused tensors, each split separately.

    Rank r holds chunk r of every section, concatenated: see `mpu.initialize_weights.shard_tensor`.
    """

    dim: int
    sections: tuple[int, ...] | None = None
    vocabulary: bool = False
    """Rows are the (padded) vocabulary."""


def tp_partition_patterns(config: GPTConfig) -> dict[str, TPPartition]:
    """regex -> how that parameter is partitioned."""
    d = config.head_dim
    qkv = (config.arch.heads * d, config.kv_heads * d, config.kv_heads * d)
    ffn = config.ffn_hidden_size
    h_to_4h = (ffn, ffn) if get_activation(config.activation).gated else (ffn,)
    patterns = {
        r"^(.*\.)?word_embeddings\.weight$": TPPartition(0, vocabulary=True),
        r"^(.*\.)?output_layer\.weight$": TPPartition(0, vocabulary=True),
        r"^(.*\.)?attention\.query_key_value\.(weight|bias)$": TPPartition(0, qkv),
        r"^(.*\.)?attention\.dense\.weight$": TPPartition(1),
        r"^(.*\.)?mlp\.dense_h_to_4h\.(weight|bias)$": TPPartition(0, h_to_4h),
        r"^(.*\.)?mlp\.dense_4h_to_h\.weight$": TPPartition(1),
        r"^(.*\.)?attention\.relative_position_bias\.weight$": TPPartition(1),
        # LoRA adapters (megatron/model/lora.py) split like their layer: B of a column-parallel layer by
        # rows (with its sections), A of a row-parallel layer by columns; the other factor is replicated
        r"^(.*\.)?attention\.query_key_value\.adapter\.lora_B$": TPPartition(0, qkv),
        r"^(.*\.)?attention\.dense\.adapter\.lora_A$": TPPartition(1),
        r"^(.*\.)?mlp\.dense_h_to_4h\.adapter\.lora_B$": TPPartition(0, h_to_4h),
        r"^(.*\.)?mlp\.dense_4h_to_h\.adapter\.lora_A$": TPPartition(1),
        r"^(.*\.)?output_layer\.adapter\.lora_B$": TPPartition(0, vocabulary=True),
    }
    if config.use_qk_layernorm and config.qk_norm_scope == "projection":
        # OLMo 2's whole-projection q/k norms: gains split with the heads (megatron/model/norm_layers.py)
        patterns[r"^(.*\.)?attention\.(q_norm|k_norm)\.weight$"] = TPPartition(0)
    families = config.layer_families
    if "mamba" in families:
        # GPT-NeoX's Mamba split (megatron/model/mamba/mamba.py): inner channels over ranks, in_proj as [x; z]
        inner = mamba_shape(config).inner
        patterns.update({
            r"^(.*\.)?mixer\.in_proj\.(weight|bias)$": TPPartition(0, (inner, inner)),
            r"^(.*\.)?mixer\.(conv1d|dt_proj)\.(weight|bias)$": TPPartition(0),
            r"^(.*\.)?mixer\.(A_log|D)$": TPPartition(0),
            r"^(.*\.)?mixer\.(x_proj|out_proj)\.weight$": TPPartition(1),
        })
    if "gmlp" in families:
        # GPT-NeoX's gMLP split (megatron/model/gmlp.py): the 4h inner width over ranks, input_linear as [res; gate]
        ff = 4 * config.arch.hidden
        patterns.update({
            r"^(.*\.)?input_linear\.(weight|bias)$": TPPartition(0, (ff, ff)),
            r"^(.*\.)?sgu\.norm\.(weight|bias)$": TPPartition(0),
            r"^(.*\.)?sgu\.attn\.proj_qkv\.weight$": TPPartition(1, (ff, ff)),
            r"^(.*\.)?sgu\.attn\.proj_ffn\.(weight|bias)$": TPPartition(0),
            r"^(.*\.)?output_linear\.weight$": TPPartition(1),
        })
    if config.moe_num_experts > 1:
        # MoE layers: tp rank r holds a contiguous block of whole experts, stacked on dim 0
        patterns[r"^(.*\.)?mlp\.experts\.(w1|w2|w1_bias|w2_bias)$"] = TPPartition(0)
    return patterns


def tp_partition_of(config: GPTConfig, name: str) -> TPPartition | None:
    """How parameter `name` is partitioned, or None if it is replicated."""
    for pattern, partition in tp_partition_patterns(config).items():
        if re.search(pattern, name):
            return partition
    return None
