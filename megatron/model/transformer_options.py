"""The transformer block's options, one registry entry each: positional embedding (``pos_emb``), attention
type (an ``attention_config`` type that is not another layer family) and MLP type (``mlp_type``).

Each entry builds (or names) its module and states what it adds to the parameter count and to the
training FLOPs per token; the transformer family's entry (registered in ``family_config.py``) adds them
up, and ``flops.py`` and ``engine/memory.py`` read that. The counting is GPT-NeoX's module shapes
(``megatron/model/transformer.py`` at ea7aefd8: fused QKV of ``(heads + 2 kv_heads) x head_dim`` rows,
``ParallelMLP``'s widths from ``mlp_width.py``). No torch import (the launcher counts with these): the
positional tables' classes are attached by ``embedding.py``, which builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.model.mlp_width import MLPWidths, legacy_llama_width, neox_mlp_widths
from megatron.model.option_registry import OptionRegistry

NormParams = Callable[[int], int]
"""Parameters of one of the config's norms over ``dim`` features."""


# --- positional embeddings ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class PositionalEntry:
    """One ``pos_emb`` value."""

    embedding: Any = None
    """The class of the table added to the token embedding (built ``cls(config, name)``), or None; Deepy's own
    are attached by ``embedding.py`` (torch modules, which this table does not import)."""
    table_rows: Callable[[Any], int] = lambda c: 0
    """Rows of that table (``hidden_size`` wide; a lookup: no FLOPs)."""
    layer_parameters: Callable[[Any], int] = lambda c: 0
    """Parameters each attention layer adds (a learned bias per distance bucket and head)."""
    additive_bias: bool = False
    """Adds a float bias to the attention scores (SDPA then takes a mask: the memory estimate's kernel)."""

    def embedding_parameters(self, config: Any) -> int:
        return self.table_rows(config) * int(config.hidden_size)

    def flops_per_token(self, config: Any) -> float:
        """Per attention layer, for MFU: 6 per weight of the layer's part (lookups are not counted)."""
        return 6.0 * self.layer_parameters(config)


POSITIONAL: OptionRegistry[PositionalEntry] = OptionRegistry("pos_emb")
for _name, _pos in {
    # GPT-NeoX's table has max_position_embeddings rows (opt_pos_emb_offset shifts inside it)
    "learned": PositionalEntry(table_rows=lambda c: int(c.max_positions)),
    "rotary": PositionalEntry(),
    "sinusoidal": PositionalEntry(),
    "rpe": PositionalEntry(layer_parameters=lambda c: int(c.rpe_num_buckets) * int(c.num_attention_heads),
                           additive_bias=True),
    "alibi": PositionalEntry(additive_bias=True),
    "none": PositionalEntry(),
}.items():
    POSITIONAL.register(_name, _pos, __name__)


# --- attention types ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionEntry:
    """One attention type of ``attention_config`` (the kernel choice, ``flash``, does not change the maths)."""

    windowed: bool = False
    """Attends over ``sliding_window_width`` previous tokens only (``local``)."""

    @staticmethod
    def parameters(config: Any, norm: NormParams) -> int:
        """Fused QKV (grouped-query: ``kv_heads`` key/value heads), output projection, their biases (the QKV's
        alone with ``use_bias_in_qkv``, Qwen2),
        the per-head q/k norms and the positional embedding's part."""
        h, d, n = int(config.hidden_size), int(config.head_dim), int(config.num_attention_heads)
        qkv_out = (n + 2 * int(config.kv_heads)) * d
        total = h * qkv_out + n * d * h + (qkv_out if config.qkv_bias else 0)
        total += h if config.use_bias_in_attn_linear else 0
        if config.use_qk_layernorm and config.qk_norm_scope == "projection":  # OLMo 2: over all heads' features
            total += norm(n * d) + norm(int(config.kv_heads) * d)
        elif config.use_qk_layernorm:
            total += 2 * norm(d)
        return total + POSITIONAL[config.pos_emb].layer_parameters(config)

    @staticmethod
    def mixing_flops(config: Any, seq_length: int) -> float:
        """Forward FLOPs per token of the score (q·k) and value (p·v) products: 2 * 2 * s * (heads * head_dim).
        Keys/values shared by GQA/MQA heads do not shrink this: every query head still scores every
        position; counted over the full sequence as PaLM and Megatron do (neither causal masking's nor
        the window's savings are subtracted, so MFU stays comparable)."""
        return 4.0 * seq_length * int(config.num_attention_heads) * int(config.head_dim)

    def flops_per_token(self, config: Any, norm: NormParams, seq_length: int) -> float:
        return 6.0 * self.parameters(config, norm) + 3.0 * self.mixing_flops(config, seq_length)


ATTENTION_TYPES: OptionRegistry[AttentionEntry] = OptionRegistry("attention type")
ATTENTION_TYPES.register("global", AttentionEntry(), __name__)
ATTENTION_TYPES.register("flash", AttentionEntry(), __name__)
ATTENTION_TYPES.register("local", AttentionEntry(windowed=True), __name__)


# --- MLP types ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class MLPEntry:
    """One ``mlp_type`` value: how wide the dense MLP is (``mlp_width.py``); built as ``model/mlp.py``'s MLP."""

    widths: Callable[[Any, bool], MLPWidths]
    """(config, activation gated) -> the two projections' widths."""

    def parameters(self, config: Any, gated: bool) -> int:
        w, h = self.widths(config, gated), int(config.hidden_size)
        return h * w.first + w.second * h + (w.first + h if config.use_bias_in_mlp else 0)

    def flops_per_token(self, config: Any, gated: bool) -> float:
        return 6.0 * self.parameters(config, gated)


def _regular(c: Any, gated: bool) -> MLPWidths:
    return neox_mlp_widths(c.hidden_size, c.intermediate_size, c.expansion_factor, c.mlp_multiple_of, gated)


def _llama(c: Any, gated: bool) -> MLPWidths:
    del gated  # always gated
    width = legacy_llama_width(c.hidden_size, c.intermediate_size)
    return MLPWidths(first=2 * width, second=width, gated=True)


MLP_TYPES: OptionRegistry[MLPEntry] = OptionRegistry("mlp_type")
MLP_TYPES.register("regular", MLPEntry(widths=_regular), __name__)
MLP_TYPES.register("llama", MLPEntry(widths=_llama), __name__)  # GPT-NeoX's LLaMAParallelMLP (mlp_width.py)


# --- norm placements -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class NormPlacementEntry:
    """One ``norm_placement`` value: which of a block's sublayers (attention, MLP) get a norm on their input and
    which on their output (before the residual add); ``transformer_layer.py`` builds exactly these."""

    before: bool
    """A norm on each sublayer's input: ``input_layernorm``, ``post_attention_layernorm`` (GPT-NeoX's names)."""
    after: bool
    """A norm on each sublayer's output: ``attention_output_norm``, ``mlp_output_norm``."""

    @property
    def norms_per_layer(self) -> int:
        """Norms over the hidden size in one block (a tied parallel residual shares its two input norms)."""
        return 2 * (int(self.before) + int(self.after))


NORM_PLACEMENTS: OptionRegistry[NormPlacementEntry] = OptionRegistry("norm_placement")
NORM_PLACEMENTS.register("pre", NormPlacementEntry(before=True, after=False), __name__)  # GPT-NeoX, Llama
NORM_PLACEMENTS.register("post", NormPlacementEntry(before=False, after=True), __name__)  # OLMo 2
NORM_PLACEMENTS.register("sandwich", NormPlacementEntry(before=True, after=True), __name__)  # Gemma 2/3


# --- the transformer block, as a layer family's counts (registered in family_config.py) -----------
def expert_parameters(config: Any) -> int:
    """One expert of an MoE layer: its width follows GPT-NeoX's expert rule; Deepy's experts gate and
    carry biases like the dense MLP."""
    h, inner = int(config.hidden_size), int(config.expert_ffn_hidden_size)
    first = 2 * inner if config.mlp_widths.gated else inner
    return h * first + inner * h + (first + h if config.use_bias_in_mlp else 0)


def layer_norms(config: Any, norm: NormParams) -> int:
    """One layer's norms over the hidden size, as ``norm_placement`` places them (one shared norm with a tied
    parallel residual)."""
    if config.gpt_j_residual and config.gpt_j_tied:
        return norm(int(config.hidden_size))
    return NORM_PLACEMENTS[config.norm_placement].norms_per_layer * norm(int(config.hidden_size))


def transformer_parameters(config: Any, layer_type: str, norm: NormParams, layer_number: int, active: bool) -> int:
    """An attention layer: attention, MLP (an MoE layer: its experts, only the ``moe_top_k`` a token
    passes through when ``active``, and the router) and norms."""
    attention = ATTENTION_TYPES[layer_type].parameters(config, norm)
    if config.is_moe_layer(layer_number):
        experts = config.moe_top_k if active else config.moe_num_experts
        mlp = experts * expert_parameters(config) + config.moe_num_experts * int(config.hidden_size)  # + router
    else:
        mlp = MLP_TYPES[config.mlp_type].parameters(config, config.mlp_widths.gated)
    return attention + mlp + layer_norms(config, norm)


def transformer_replicated(config: Any, layer_type: str, norm: NormParams) -> int:
    """What tensor parallelism does not split: norms and the biases added after the row-parallel projections."""
    del layer_type
    h = int(config.hidden_size)
    return layer_norms(config, norm) + (h if config.use_bias_in_attn_linear else 0) + (h if config.use_bias_in_mlp else 0)


def transformer_mixing_flops(config: Any, layer_type: str, seq_length: int) -> float:
    return ATTENTION_TYPES[layer_type].mixing_flops(config, seq_length)
