"""Before-launch checks of the model's shape: heads, key/value heads, positions, rope scaling and the
padded vocabulary, against the tensor- and pipeline-parallel sizes that split them (read through the
context). Registered with every other check (``megatron/config_rules.py``).

The model's own guard (:meth:`megatron.model.config.GPTConfig.check_architecture`, for models built
outside ``deepy.py``: tools, conversions, tests) runs the same functions through :class:`ConfigView`,
so each invariant is written once.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron.config_rules import RuleContext, render, rule
from megatron.model.family_config import configured_families, expand_layer_types
from megatron.model.mlp_width import GATED_ACTIVATIONS, neox_mlp_widths, width_problem


class ModelKeys(Protocol):
    """What the shape checks read: a :class:`~megatron.config_rules.RuleContext` before launch, a
    :class:`ConfigView` of a model config when the model is built."""

    @property
    def tp(self) -> int: ...

    def get(self, key: str) -> Any: ...

    def show(self, key: str) -> str: ...


class ConfigView:
    """A model config read the way a check reads the user's arguments (``get``, ``show``, ``tp``), for the
    model's own guard; no provenance, so a setting is shown as ``key=value``."""

    def __init__(self, config: Any, tp: int = 1) -> None:
        self.config, self.tp = config, tp

    def get(self, key: str) -> Any:
        return getattr(self.config, key)

    def show(self, key: str) -> str:
        return f"{key}={render(self.get(key))}"


MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


@rule
def model_shape_given(ctx: ModelKeys) -> list[str]:
    missing = [key for key in MODEL_SHAPE_KEYS if ctx.get(key) is None]
    if not missing:
        return []
    return [f"{', '.join(missing)} not set: every model needs {', '.join(MODEL_SHAPE_KEYS)}"]


@rule
def heads_divide_hidden(ctx: ModelKeys) -> list[str]:
    hidden, heads = ctx.get("hidden_size"), ctx.get("num_attention_heads")
    if hidden is None or heads is None or hidden % heads == 0 or ctx.get("kv_channels") is not None:
        return []  # with kv_channels each head's width is given, hidden_size need not divide
    if "mamba" in configured_families(ctx.get("attention_config")):
        return []  # GPT-NeoX skips this check for Mamba models (arguments.py:1245, ea7aefd8)
    return [
        f"{ctx.show('hidden_size')} is not divisible by {ctx.show('num_attention_heads')}: each "
        f"head gets hidden_size/num_attention_heads channels; pick a head count that divides "
        f"{hidden}"
    ]


@rule
def heads_divide_over_tp(ctx: RuleContext) -> list[str]:
    heads = ctx.get("num_attention_heads")
    if heads is None or heads % ctx.tp == 0:
        return []
    return [
        f"{ctx.show('num_attention_heads')} is not divisible by {ctx.show('model_parallel_size')}: "
        f"tensor parallelism gives each rank whole heads; use a model_parallel_size that divides "
        f"{heads}"
    ]


@rule
def kv_heads_fit(ctx: ModelKeys) -> list[str]:
    heads, kv = ctx.get("num_attention_heads"), ctx.get("num_kv_heads")
    if heads is None or kv is None:
        return []
    problems = []
    if kv > heads or heads % kv != 0:
        problems.append(
            f"{ctx.show('num_kv_heads')} does not divide {ctx.show('num_attention_heads')}: grouped "
            f"query attention shares each key/value head among heads/num_kv_heads query heads"
        )
    tp = ctx.tp
    # The attention layer splits key/value heads across tensor-parallel ranks; replicating one kv
    # head over several ranks (tp > kv) is not implemented, so kv must be a multiple of tp.
    if kv % tp != 0:
        problems.append(
            f"{ctx.show('num_kv_heads')} is not divisible by {ctx.show('model_parallel_size')}: each "
            f"tensor-parallel rank holds whole key/value heads; use a model_parallel_size that divides "
            f"num_kv_heads"
        )
    return problems


@rule
def layers_cover_stages(ctx: RuleContext) -> list[str]:
    layers, stages = ctx.get("num_layers"), ctx.pipe_parallel_size
    if layers is None or stages <= 1 or layers >= stages:
        return []
    return [
        f"{ctx.show('num_layers')} is fewer than {ctx.show('pipe_parallel_size')}: every pipeline "
        f"stage needs at least one transformer layer; lower pipe_parallel_size to {layers} or less"
    ]


@rule
def sequence_fits_positions(ctx: RuleContext) -> list[str]:
    seq, positions = ctx.get("seq_length"), ctx.get("max_position_embeddings")
    if seq is None or positions is None or seq <= positions:
        return []
    return [
        f"{ctx.show('seq_length')} exceeds {ctx.show('max_position_embeddings')}: raise "
        f"max_position_embeddings to at least {seq} (or remove it to default to seq_length)"
    ]


@rule
def rope_scaling_is_honoured(ctx: ModelKeys) -> list[str]:
    """rope_scaling is HF's dict of one of its kinds, and only rotary positions can be scaled."""
    value = ctx.get("rope_scaling")
    if value is None:
        return []
    if ctx.get("pos_emb") != "rotary":
        return [f"{ctx.show('rope_scaling')} scales rotary positions, but {ctx.show('pos_emb')}: set pos_emb: "
                "rotary or remove rope_scaling"]
    # lazy: rope_scaling imports torch; the launcher runs these checks without it
    from megatron.model.rope_scaling import RopeScalingError, parse_rope_scaling

    try:
        parse_rope_scaling(value, ctx.get("max_position_embeddings") or ctx.get("seq_length"),
                           own={key: ctx.get(key) for key in ("rotary_emb_base", "rotary_pct")})
    except RopeScalingError as err:
        return [f"{ctx.show('rope_scaling')}: {err}"]
    return []


@rule
def vocab_padding_splits_over_tp(ctx: RuleContext) -> list[str]:
    padded = ctx.get("padded_vocab_size")
    if padded is None or not ctx.given("padded_vocab_size"):
        return []
    multiple = int(ctx.get("make_vocab_size_divisible_by") or 1) * ctx.tp
    if padded % multiple == 0:
        return []
    return [
        f"{ctx.show('padded_vocab_size')} is not a multiple of make_vocab_size_divisible_by x "
        f"model_parallel_size = {multiple}: each tensor-parallel rank holds an equal slice of the "
        f"vocabulary; remove padded_vocab_size so it is computed from the tokenizer"
    ]


@rule
def mlp_widths_fit(ctx: ModelKeys) -> list[str]:
    """The MLP widths GPT-NeoX's rule gives fit each other (``megatron/model/mlp_width.py``), and only one
    of intermediate_size / expansion_factor sizes it (GPT-NeoX asserts that, transformer.py:106)."""
    hidden, size, factor = ctx.get("hidden_size"), ctx.get("intermediate_size"), ctx.get("expansion_factor")
    if hidden is None:
        return []
    if size is not None and factor is not None:
        return [f"{ctx.show('intermediate_size')} and {ctx.show('expansion_factor')} both size the MLP; GPT-NeoX "
                f"accepts only one of them: remove one"]
    if ctx.get("mlp_type") == "llama":
        return []  # each half is intermediate_size wide as given (mlp_width.legacy_llama_width)
    if int(ctx.get("moe_num_experts") or 1) > 1 and int(ctx.get("moe_expert_interval") or 1) == 1:
        return []  # every block's MLP is a mixture of experts, each intermediate_size wide (mlp_width.expert_width)
    multiple = ctx.get("mlp_multiple_of")
    gated = ctx.get("activation") in GATED_ACTIVATIONS
    problem = width_problem(neox_mlp_widths(hidden, size, factor, multiple, gated), hidden, size, factor, multiple)
    if problem is None:
        return []
    sizing = ctx.show("intermediate_size") if size is not None else (
        ctx.show("expansion_factor") if factor is not None else f"{ctx.show('hidden_size')} (F = 4 x hidden_size)")
    return [f"{sizing} with {ctx.show('mlp_multiple_of')} and {ctx.show('activation')}: {problem}"]


@rule
def rotary_dims_even(ctx: ModelKeys) -> list[str]:
    """Rotary rotates pairs of dimensions: GPT-NeoX's RotaryEmbedding builds cos/sin for an even count
    only (``torch.cat((freqs, freqs))`` is one wider than an odd count), so an odd one is refused."""
    hidden, heads, pct = ctx.get("hidden_size"), ctx.get("num_attention_heads"), ctx.get("rotary_pct")
    head = ctx.get("kv_channels")
    if head is None:
        if ctx.get("pos_emb") != "rotary" or hidden is None or not heads or hidden % heads:
            return []
        head = hidden // heads
    elif ctx.get("pos_emb") != "rotary":
        return []
    dims = head if pct == 1 else int(head * pct)
    if dims % 2 == 0:
        return []
    return [f"{ctx.show('rotary_pct')} rotates {dims} of each head's {head} dimensions (int(head_dim x rotary_pct), "
            f"as GPT-NeoX computes it): rotary needs an even count; choose a rotary_pct that gives one"]


@rule
def parallel_residual_keeps_attention(ctx: ModelKeys) -> list[str]:
    """GPT-NeoX's parallel residual adds the attention output to the MLP's only through the MLP's bias:
    without one (use_bias_in_mlp false, or an MoE layer, which has none) it computes x + mlp(norm(x))
    and drops the attention (transformer.py:1102-1113 at ea7aefd8). Deepy would build the block with
    attention, a different model, so the combination is refused."""
    if not ctx.get("gpt_j_residual"):
        return []
    why = []
    if not ctx.get("use_bias_in_mlp"):
        why.append(ctx.show("use_bias_in_mlp"))
    if (ctx.get("moe_num_experts") or 1) > 1:
        why.append(f"{ctx.show('moe_num_experts')} (MoE layers have no bias)")
    if not why:
        return []
    return [f"{ctx.show('gpt_j_residual')} with {' and '.join(why)}: GPT-NeoX's parallel residual then drops the "
            f"attention output (it is added together with the MLP's bias only); set use_bias_in_mlp: true "
            f"without MoE, or gpt_j_residual: false"]


@rule
def norm_placement_and_qk_norm_scope_fit(ctx: ModelKeys) -> list[str]:
    """norm_placement post/sandwich is built for the sequential block only (GPT-NeoX's parallel residual and
    Transformer Engine's fused LayerNormMLP take the pre-norm's input norm); qk_norm_scope projection normalises
    with RMSNorm (OLMo 2's Olmo2RMSNorm, transformers 5.23.0 modeling_olmo2.py:50-64), reducing its sum of
    squares over the tensor-parallel ranks, and only with use_qk_layernorm."""
    problems = []
    placement = ctx.get("norm_placement")
    if placement != "pre":
        if ctx.get("gpt_j_residual"):
            problems.append(f"{ctx.show('norm_placement')} with {ctx.show('gpt_j_residual')}: the parallel residual "
                            f"is built with norms before its sublayers only; set norm_placement: pre")
        if ctx.get("te_layernorm_mlp"):
            problems.append(f"{ctx.show('norm_placement')} with {ctx.show('te_layernorm_mlp')}: Transformer Engine's "
                            f"LayerNormMLP fuses the norm before the MLP; set te_layernorm_mlp: false")
    if ctx.get("qk_norm_scope") == "projection":
        if not ctx.get("use_qk_layernorm"):
            problems.append(f"{ctx.show('qk_norm_scope')} without use_qk_layernorm: there are no query/key norms to "
                            f"scope; set use_qk_layernorm: true (or leave qk_norm_scope at head)")
        elif ctx.get("norm") != "rmsnorm":
            problems.append(f"{ctx.show('qk_norm_scope')} with {ctx.show('norm')}: the whole-projection query/key "
                            f"norm is built as RMSNorm (OLMo 2's); set norm: rmsnorm or qk_norm_scope: head")
    return problems


@rule
def positions_fit_the_learned_table(ctx: ModelKeys) -> list[str]:
    """GPT-NeoX's learned table has max_position_embeddings rows and positions are shifted by
    opt_pos_emb_offset before the lookup (word_embeddings.py:88-91, 143-149 at ea7aefd8)."""
    offset, seq = ctx.get("opt_pos_emb_offset") or 0, ctx.get("seq_length")
    positions = ctx.get("max_position_embeddings") or seq
    if ctx.get("pos_emb") != "learned" or not offset or seq is None:
        return []
    if seq + offset <= positions:
        return []
    return [f"{ctx.show('seq_length')} + {ctx.show('opt_pos_emb_offset')} exceeds {ctx.show('max_position_embeddings')}: "
            f"the learned table has max_position_embeddings rows and positions are shifted by the offset; "
            f"set max_position_embeddings: {seq + offset}"]


@rule
def layernorm_bias_key(ctx: RuleContext) -> list[str]:
    """``use_bias_in_norms`` is declared by GPT-NeoX but read by none of its layers (its LayerNorm always
    has a bias); Deepy honours it. Say so where the two differ."""
    if ctx.get("norm") in ("layernorm", "te_layernorm") and not ctx.get("use_bias_in_norms"):
        ctx.warnings.append(f"{ctx.show('use_bias_in_norms')}: Deepy builds LayerNorms without a bias; GPT-NeoX "
                            f"ignores this key (its LayerNorm always has one), so GPT-NeoX builds another model")
    return []


@rule
def fused_gelu_has_a_bias(ctx: ModelKeys) -> list[str]:
    """GPT-NeoX's fused bias+GeLU kernel adds the MLP's bias, and fails without one (transformer.py:168-171)."""
    if ctx.get("bias_gelu_fusion") and ctx.get("activation") == "gelu" and not ctx.get("use_bias_in_mlp"):
        return [f"{ctx.show('bias_gelu_fusion')} with {ctx.show('use_bias_in_mlp')}: GPT-NeoX's fused kernel (tanh "
                f"GeLU) adds the MLP's bias and cannot run without one; set activation: gelu_tanh instead"]
    return []


@rule
def rpe_distance_exceeds_half_the_buckets(ctx: ModelKeys) -> list[str]:
    """T5's relative position buckets: half are exact distances, the others log-spaced up to rpe_max_distance, which
    must lie beyond the exact half (``positional.RelativePositionBias``)."""
    if ctx.get("pos_emb") != "rpe":
        return []
    distance, buckets = ctx.get("rpe_max_distance"), ctx.get("rpe_num_buckets")
    if distance is None or buckets is None or distance > buckets // 2:
        return []
    return [f"{ctx.show('rpe_max_distance')} must exceed half of {ctx.show('rpe_num_buckets')}: half the buckets are "
            f"exact distances, the rest are log-spaced up to rpe_max_distance; raise it above {buckets // 2}"]


@rule
def local_attention_has_a_window(ctx: ModelKeys) -> list[str]:
    """A ``local`` layer attends over the last sliding_window_width tokens, so it needs the width."""
    config, layers = ctx.get("attention_config"), ctx.get("num_layers")
    if not config or layers is None or ctx.get("sliding_window_width") is not None:
        return []
    try:
        types = expand_layer_types(config, layers)
    except ValueError:
        return []  # attention_config_covers_layers names it
    if "local" not in types:
        return []
    return [f"{ctx.show('attention_config')} has local attention layers: each needs sliding_window_width (the "
            f"number of previous tokens they attend to): set it"]


@rule
def sequence_parallel_splits_the_sequence(ctx: RuleContext) -> list[str]:
    """Sequence parallelism gives each tensor-parallel rank seq_length / model_parallel_size tokens of every
    sequence between the layers (``mpu/mappings.py`` refuses a length that does not split)."""
    seq = ctx.get("seq_length")
    if not ctx.get("sequence_parallel") or ctx.tp <= 1 or seq is None or seq % ctx.tp == 0:
        return []
    return [f"{ctx.show('sequence_parallel')} splits each sequence of {ctx.show('seq_length')} over "
            f"{ctx.show('model_parallel_size')}: use a seq_length that is a multiple of {ctx.tp}"]


TE_MLP_ACTIVATIONS = ("gelu", "geglu", "relu", "reglu", "squared_relu", "swiglu", "qgelu", "srelu")
"""Activations Transformer Engine's LayerNormMLP computes (GPT-NeoX ea7aefd8's TELayerNormMLP list)."""
TE_NORMS = ("layernorm", "te_layernorm", "rmsnorm", "te_rmsnorm")
"""The ``norm`` values Transformer Engine's fused modules compute (its LayerNorm and RMSNorm)."""


@rule
def transformer_engine_fuses_this_mlp(ctx: ModelKeys) -> list[str]:
    """``te_layernorm_mlp`` fuses a LayerNorm or RMSNorm with one of Transformer Engine's activations; GPT-NeoX's
    TELayerNormMLP raises otherwise (ea7aefd8 megatron/model/transformer_engine.py). Checked where the library runs:
    elsewhere the key is refused first (it needs Transformer Engine on an NVIDIA GPU)."""
    if not ctx.get("te_layernorm_mlp"):
        return []
    problems = []
    if ctx.get("norm") not in TE_NORMS:  # what te_normalization refuses on the ranks
        problems.append(f"{ctx.show('te_layernorm_mlp')} fuses a LayerNorm or RMSNorm: {ctx.show('norm')} is neither; "
                        f"set norm: {', '.join(TE_NORMS)}")
    if ctx.get("activation") not in TE_MLP_ACTIVATIONS:
        problems.append(f"{ctx.show('te_layernorm_mlp')} computes the activations {', '.join(TE_MLP_ACTIVATIONS)}: "
                        f"{ctx.show('activation')} is not one of them")
    return problems
