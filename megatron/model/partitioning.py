"""Which parameters are split across tensor-parallel ranks, and how (for checkpoint resharding).

Patterns are regexes for `re.match` (they are anchored) on a parameter's name; they match `GPTModel` names
(`layers.3.attention.dense.weight`) and pipeline layer names (`4.attention.dense.weight`) alike.
A parameter that matches no pattern is replicated on every tp rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron.model.activations import get_activation
from megatron.model.config import GPTConfig


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
    qkv = (config.num_attention_heads * d, config.kv_heads * d, config.kv_heads * d)
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
    }
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


def _name(*suffixes: str) -> str:
    """A `re.match` pattern for any parameter whose name ends with one of `suffixes`."""
    return rf"^(.*\.)?({'|'.join(re.escape(x) for x in suffixes)})$"


def universal_checkpoint_info(config: GPTConfig, tp: int, original_vocab_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed's `universal_checkpoint_info` for a checkpoint of this model saved at `tp`.

    Goes into the checkpoint's client state under `deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO`
    so `ds_to_universal` can merge the tp shards: replicated params are taken from rank 0,
    row-parallel ones concatenated on dim 1, fused QKV / gated-MLP weights (sections) merged per
    section, and (with `original_vocab_size`) vocabulary padding stripped. Every pattern listed
    matches at least one parameter of this config (DeepSpeed's strict mode rejects unused ones).
    """
    from deepspeed.checkpoint import constants as k

    norm_fields = {
        "layernorm": ["weight", "bias"] if config.use_bias_in_norms else ["weight"],
        "rmsnorm": ["weight"],
        "scalenorm": ["g"],
        "non_parametric_layernorm": [],
    }[config.norm.removeprefix("te_")]
    norm_modules = ["input_layernorm", "final_norm"]
    if not (config.gpt_j_residual and config.gpt_j_tied):
        norm_modules.append("post_attention_layernorm")
    if config.use_qk_layernorm:
        norm_modules += ["q_norm", "k_norm"]
    replicated = [f"{m}.{f}" for m in norm_modules for f in norm_fields]
    if config.pos_emb == "learned":
        replicated.append("position_embeddings.weight")
    if config.value_head:
        replicated.append("value_head.weight")
    if config.use_bias_in_attn_linear:
        replicated.append("attention.dense.bias")
    dense_mlp = config.num_moe_layers < config.num_layers
    if config.use_bias_in_mlp and dense_mlp:
        replicated.append("mlp.dense_4h_to_h.bias")
    if config.moe_num_experts > 1:
        replicated.append("mlp.router.weight")

    row_parallel = ["attention.dense.weight"] + (["mlp.dense_4h_to_h.weight"] if dense_mlp else [])
    if config.pos_emb == "rpe":
        row_parallel.append("attention.relative_position_bias.weight")  # split over heads, dim 1
    fused: dict[str, tuple[tuple[int, ...], bool]] = {}
    for pattern, part in tp_partition_patterns(config).items():
        if part.sections is not None and len(part.sections) > 1:
            module = "attention.query_key_value" if "query_key_value" in pattern else "mlp.dense_h_to_4h"
            if module == "mlp.dense_h_to_4h" and not dense_mlp:
                continue
            bias = config.use_bias_in_attn_linear if module.startswith("attention") else config.use_bias_in_mlp
            fused[module] = (part.sections, bias)
    sub_params: list[dict[str, Any]] = []
    shard_widths: dict[str, list[list[int]]] = {}
    for module, (sections, bias) in fused.items():
        fields = [("weight", (config.hidden_size,))] + ([("bias", ())] if bias else [])
        for field, trailing in fields:
            pattern = _name(f"{module}.{field}")
            sub_params.append({"patterns": [pattern], "shape": (tuple(sections), *trailing), "partition_dim": 0})
            shard_widths[pattern] = [[section // tp] * tp for section in sections]

    info: dict[str, Any] = {
        k.UNIVERSAL_CHECKPOINT_VERSION_KEY: k.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        k.TP_REPLICATED_PARAMETER_PATTERNS: [_name(x) for x in replicated],
        k.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [_name(*row_parallel)],
        k.PARAMETER_WITH_SUB_PARAMS: sub_params,
        k.SUB_PARAM_SHARD_WIDTHS: shard_widths,
    }
    if original_vocab_size is not None:
        untied = config.no_weight_tying and not config.value_head
        vocab = ["word_embeddings.weight"] + (["output_layer.weight"] if untied else [])
        info[k.VOCABULARY_PARAMETER_PATTERNS] = [_name(*vocab)]
        info[k.ORIGINAL_VOCAB_SIZE] = original_vocab_size
    return info

