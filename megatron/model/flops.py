"""Parameter count and training FLOPs per token, for MFU.

Pure arithmetic on the config (no model is built), so it is cheap for any size.
"""

from __future__ import annotations

from megatron.errors import required
from megatron.model import family_config as families
from megatron.model.config import GPTConfig

# parameters of one norm over `dim` features
_NORM_PARAMS = {
    "layernorm": lambda dim, c: dim * (2 if c.use_bias_in_norms else 1),
    "rmsnorm": lambda dim, c: dim,
    "scalenorm": lambda dim, c: 1,
    "non_parametric_layernorm": lambda dim, c: 0,
}
_NORM_PARAMS["te_layernorm"] = _NORM_PARAMS["layernorm"]
_NORM_PARAMS["te_rmsnorm"] = _NORM_PARAMS["rmsnorm"]


def norm_parameters(config: GPTConfig, dim: int) -> int:
    """Parameters of one of the config's norms over ``dim`` features."""
    return _NORM_PARAMS[config.norm](dim, config)


_norm_params = norm_parameters


def mlp_parameters(config: GPTConfig, expert: bool = False) -> int:
    """Parameters of one dense MLP (``expert``: of one expert of an MoE layer, whose width follows
    GPT-NeoX's expert rule; Deepy's experts gate and carry biases like the dense MLP)."""
    h = config.arch.hidden
    if expert:
        inner = config.expert_ffn_hidden_size
        first = 2 * inner if config.mlp_widths.gated else inner
    else:
        first, inner = config.mlp_widths.first, config.mlp_widths.second
    return h * first + inner * h + (first + h if config.use_bias_in_mlp else 0)


def layer_parameters(config: GPTConfig, layer_number: int = 0, active: bool = False) -> int:
    """Parameters of one transformer layer. An MoE layer holds ``moe_num_experts`` experts and a
    router; with ``active`` only the ``moe_top_k`` experts a token passes through count. A Mamba, RWKV or
    gMLP layer counts its own (``family_config.layer_parameters``)."""
    kind = config.attention_types[layer_number]
    if families.family_of(kind) != "transformer":
        return families.layer_parameters(config, kind, lambda dim: _norm_params(config, dim))
    h, d = config.arch.hidden, config.head_dim
    qkv_out = (config.arch.heads + 2 * config.kv_heads) * d
    attn_bias = config.use_bias_in_attn_linear
    attention = h * qkv_out + config.arch.heads * d * h + (qkv_out + h if attn_bias else 0)
    if config.use_qk_layernorm:
        attention += 2 * _norm_params(config, d)
    if config.pos_emb == "rpe":
        attention += config.rpe_num_buckets * config.arch.heads
    if config.is_moe_layer(layer_number):
        experts = config.moe_top_k if active else config.moe_num_experts
        mlp = experts * mlp_parameters(config, expert=True) + config.moe_num_experts * h  # + the router
    else:
        mlp = mlp_parameters(config)
    return attention + mlp + layer_norm_parameters(config)


def layer_norm_parameters(config: GPTConfig) -> int:
    """Parameters of one layer's norms (one shared norm with a tied parallel residual)."""
    norms = 1 if (config.gpt_j_residual and config.gpt_j_tied) else 2
    return norms * _norm_params(config, config.arch.hidden)


def final_norm_parameters(config: GPTConfig) -> int:
    return _norm_params(config, config.arch.hidden)


def embedding_parameters(config: GPTConfig) -> int:
    """The input tables: the (padded) token embedding and a learned position table of
    ``max_position_embeddings`` rows (GPT-NeoX's size; ``opt_pos_emb_offset`` shifts inside it)."""
    h = config.arch.hidden
    positions = config.max_positions * h if config.pos_emb == "learned" else 0
    return config.vocab * h + positions


def head_parameters(config: GPTConfig) -> int:
    """The output side's own parameters: an untied output projection (vocab x h), a value head (h),
    or none when the output reuses the token embedding."""
    if config.value_head:
        return config.arch.hidden
    return config.vocab * config.arch.hidden if config.no_weight_tying else 0


def num_parameters(config: GPTConfig, include_embeddings: bool = True, active: bool = False) -> int:
    """Unique parameters of the full (unsharded) model; a tied output projection counts once.
    ``include_embeddings=False`` leaves out the token and position tables and an untied output
    projection (Pythia's "non-embedding" count); ``active``: only the experts one token uses (what its
    FLOPs see)."""
    total = sum(layer_parameters(config, i, active) for i in range(config.arch.layers)) + final_norm_parameters(config)
    if config.value_head:
        total += head_parameters(config)
    if include_embeddings:
        total += embedding_parameters(config) + (0 if config.value_head else head_parameters(config))
    return total


def _attention_flops_per_layer(config: GPTConfig, seq_length: int, layer_number: int = 0) -> float:
    """Forward FLOPs per token of one layer's score (q·k) and value (p·v) products: 2 * 2 * s *
    (heads * head_dim). Keys/values shared by GQA/MQA heads do not shrink this: every query head
    still scores every position. A Mamba/RWKV/gMLP layer's scan, recurrence or spatial projection
    instead (``family_config.token_mixing_flops``)."""
    kind = config.attention_types[layer_number]
    if families.family_of(kind) != "transformer":
        return families.token_mixing_flops(config, kind, seq_length)
    return 4.0 * seq_length * config.arch.heads * config.head_dim


def flops_per_token(config: GPTConfig, seq_length: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token: 6N + 12 L s (heads * head_dim).

    N counts the weights that take part in matmuls: every non-embedding parameter plus the output
    projection (vocab x h, tied or not; h for a value head); the lookup tables do no matmul. The
    attention term is the score and value products (:func:`_attention_flops_per_layer`, x3 with the
    backward), counted over the full sequence as PaLM and Megatron do (causal masking's savings are
    not subtracted), and the sliding window's savings are not counted, so MFU stays comparable.
    In MoE layers only the ``moe_top_k`` experts a token visits (and the router) count.
    """
    s = required(config.seq_length, "seq_length", "FLOPs per token depend on it") if seq_length is None else seq_length
    matmul_params = num_parameters(config, include_embeddings=False, active=True)
    # a Mamba/RWKV/gMLP layer's parameters that take part in no matmul (decays, convolutions, ...)
    matmul_params -= sum(families.non_matmul_parameters(config, kind) for kind in config.attention_types)
    if not config.value_head:
        matmul_params += config.vocab * config.arch.hidden  # the output projection, tied or not
    mixing = sum(_attention_flops_per_layer(config, s, i) for i in range(config.arch.layers))
    return 6.0 * matmul_params + 3.0 * mixing


def hardware_flops_per_token(config: GPTConfig, recomputed_layers: int, seq_length: int | None = None) -> float:
    """:func:`flops_per_token` plus one more forward of each of ``recomputed_layers`` transformer
    layers (activation checkpointing recomputes them in the backward); the basis of HFU."""
    s = required(config.seq_length, "seq_length", "FLOPs per token depend on it") if seq_length is None else seq_length
    kind = config.attention_types[0]
    matmul = layer_parameters(config) - families.non_matmul_parameters(config, kind)
    layer_forward = 2.0 * matmul + _attention_flops_per_layer(config, s)
    return flops_per_token(config, s) + recomputed_layers * layer_forward
