"""Parameter count and training FLOPs per token, for MFU: the sum of the registry entries' counts.

Each architectural option states its own parameters and FLOPs per token (``norms.NORMS``,
``transformer_options`` for positional embeddings, attention types and MLP types, ``family_config.FAMILIES``
for the layer families); this module adds them up for a whole model. Pure arithmetic on the config
(no model is built, no torch), so it is cheap for any size; ``engine/memory.py`` counts with it.
"""

from __future__ import annotations

from megatron.errors import required
from megatron.model import family_config as families
from megatron.model.config import GPTConfig
from megatron.model.norms import norm_entry
from megatron.model.transformer_options import POSITIONAL


def norm_parameters(config: GPTConfig, dim: int) -> int:
    """Parameters of one of the config's norms over ``dim`` features (its registry entry's count)."""
    settings = config.norm_settings
    return norm_entry(settings).parameters(dim, settings)


def _norm(config: GPTConfig) -> families.NormParams:
    settings = config.norm_settings
    entry = norm_entry(settings)
    return lambda dim: entry.parameters(dim, settings)


def layer_parameters(config: GPTConfig, layer_number: int = 0, active: bool = False) -> int:
    """Parameters of one layer: its family's entry. An MoE layer holds ``moe_num_experts`` experts and a
    router; with ``active`` only the ``moe_top_k`` experts a token passes through count."""
    kind = config.attention_types[layer_number]
    return families.layer_parameters(config, kind, _norm(config), layer_number, active)


def final_norm_parameters(config: GPTConfig) -> int:
    return norm_parameters(config, config.arch.hidden)


def embedding_parameters(config: GPTConfig) -> int:
    """The input tables: the (padded) token embedding and the positional entry's table (learned:
    ``max_position_embeddings`` rows, GPT-NeoX's size; ``opt_pos_emb_offset`` shifts inside it)."""
    return config.vocab * config.arch.hidden + POSITIONAL[config.pos_emb].embedding_parameters(config)


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


def layer_flops_per_token(config: GPTConfig, layer_number: int, seq_length: int) -> float:
    """Training FLOPs per token of one layer (its family entry's: 6 per weight a token passes through,
    3 x the forward FLOPs of what mixes positions)."""
    kind = config.attention_types[layer_number]
    return families.family_entry(kind).flops_per_token(config, kind, _norm(config), seq_length, layer_number)


def flops_per_token(config: GPTConfig, seq_length: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token: 6N + 12 L s (heads * head_dim).

    N counts the weights that take part in matmuls: every non-embedding parameter plus the output
    projection (vocab x h, tied or not; h for a value head); the lookup tables do no matmul. The
    attention term is the score and value products (``AttentionEntry.mixing_flops``, x3 with the
    backward), counted over the full sequence as PaLM and Megatron do (causal masking's savings are
    not subtracted), and the sliding window's savings are not counted, so MFU stays comparable.
    In MoE layers only the ``moe_top_k`` experts a token visits (and the router) count.
    """
    s = required(config.seq_length, "seq_length", "FLOPs per token depend on it") if seq_length is None else seq_length
    h = config.arch.hidden
    layers = sum(layer_flops_per_token(config, i, s) for i in range(config.arch.layers))
    final_norm = norm_entry(config.norm_settings).flops_per_token(h, config.norm_settings)
    output = h if config.value_head else config.vocab * h  # tied or not
    return layers + final_norm + 6.0 * output


def hardware_flops_per_token(config: GPTConfig, recomputed_layers: int, seq_length: int | None = None) -> float:
    """:func:`flops_per_token` plus one more forward of each of ``recomputed_layers`` layers
    (activation checkpointing recomputes them in the backward); the basis of HFU."""
    s = required(config.seq_length, "seq_length", "FLOPs per token depend on it") if seq_length is None else seq_length
    kind = config.attention_types[0]
    entry = families.family_entry(kind)
    matmul = entry.parameters(config, kind, _norm(config), 0, False) - entry.non_matmul(config, kind)
    layer_forward = 2.0 * matmul + entry.mixing_flops(config, kind, s)
    return flops_per_token(config, s) + recomputed_layers * layer_forward
