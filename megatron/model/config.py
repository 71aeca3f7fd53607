"""The architecture: sizes, norms, positional embeddings, activations, initialisation, biases, and
the values every layer is built from: dropout (GPT-NeoX's ``NeoXArgsTraining``), the padded vocabulary
(``NeoXArgsTokenizer``), the seed the weights are drawn from (``NeoXArgsOther``) and sequence
parallelism (``NeoXArgsParallelism``). The MoE layer's keys are its own group (``moe_config.py``).
Fused-kernel switches are accepted as performance hints. Switches for Transformer Engine and online
weight serving belong to features Deepy does not build yet and are accepted only at their defaults. The
Mamba, RWKV and gMLP layers' keys are GPT-NeoX's model keys too; the sizes they derive are worked out in
``family_config.py``.

:class:`GPTConfig` declares these keys once, with GPT-NeoX's names and defaults; ``NeoXArgs`` is composed
of it, the trainer builds the model from its own instance of this group, and interop and tests construct it
with the same names. What every module derives from the keys (head dim, kv heads, MLP width, rotary
dims, attention types, the weight dtype) is a property here, computed the same way everywhere.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field, PrivateAttr, field_validator

from megatron.config_rules import RuleContext, describe, rule
from megatron.config_schema import not_supported
from megatron.config_schema import TRANSFORMER_ENGINE, needs_gpu_library, obsolete
from megatron.config_schema import partly_supported
from megatron.config_support import KNOWN_ATTENTION_TYPES, SPARSE_ATTENTION_GONE
from megatron.errors import ConfigError
from megatron.model.activations import ACTIVATIONS, is_gated
from megatron.model import checks, family_checks, moe_checks
from megatron.model.checks import ConfigView
from megatron.model.family_checks import tensor_parallel_splits
from megatron.model.mlp_width import MLPWidths, expert_width
from megatron.model.norms import NORMS, NORM_KEYS, NormSettings
from megatron.model.family_config import FAMILY_OF_TYPE, FamilyName, expand_layer_types, family_of
from megatron.model.moe_config import MoEArgs
from megatron.model.mup_config import MupArgs
from megatron.model.transformer_options import ATTENTION_TYPES, MLP_TYPES, POSITIONAL

if TYPE_CHECKING:
    import torch

    from megatron.model.rope_scaling import RopeScaling
    from megatron.mpu.initialize_weights import InitFn

PositionEmbedding = Literal["learned", "rotary", "sinusoidal", "rpe", "alibi", "none"]
"""The ``pos_emb`` values: ``transformer_options.POSITIONAL``'s names (tests/unit/test_option_registries.py)."""
# the activation values: ``activations.ACTIVATIONS``'s names (tests/unit/test_option_registries.py)
Activation = Literal[
    "gelu",
    "gelu_tanh",
    "geglu",
    "geglu_tanh",
    "relu",
    "softsign",
    "swish",
    "mish",
    "silu",
    "reglu",
    "swiglu",
    "bilinear",
    "glu",
]
InitMethod = Literal[
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
]


_INIT_METHODS = typing.get_args(InitMethod)

# attention types a layer may have (the kernel choice, "flash", does not change the maths)
_LOCAL_ATTENTION = {name for name, entry in ATTENTION_TYPES.items() if entry.windowed}

# the argument object is loaded by deepy.py before any rank starts: torch, the layer registries and the
# weight initialisers are imported where the model uses them, so loading a config stays light
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bfloat16": "bfloat16"}


class ModelConfigError(ConfigError, ValueError):
    """An architecture the model cannot build (a ConfigError for the entry points, a ValueError for callers)."""


@dataclass(frozen=True, slots=True)
class Architecture:
    """The sizes every layer is built from, never None (:attr:`GPTConfig.arch`): the schema's fields
    stay nullable (a config may leave them to a rule), the model, the parameter count, the FLOPs and the
    memory estimate compute with these."""

    layers: int
    """``num_layers``."""
    hidden: int
    """``hidden_size`` (h)."""
    heads: int
    """``num_attention_heads``."""


class GPTConfig(MoEArgs, MupArgs):
    """GPT-NeoX's ``NeoXArgsModel`` group, with the dropout, padded vocabulary, seed and sequence
    parallelism that the layers are built from, and the MoE layer's keys (inherited from :class:`MoEArgs`) and
    muP's (:class:`MupArgs`)."""

    precision: Literal["fp16", "fp32", "bfloat16"] | None = None
    """Training dtype: fp16 (with loss scaling), bfloat16, or fp32; derived from the fp16/bf16
    blocks when unset."""

    num_layers: int | None = Field(None, ge=1)
    """Number of transformer blocks."""

    hidden_size: int | None = Field(None, ge=1)
    """Width of the residual stream."""

    intermediate_size: int | None = Field(None, ge=1)
    """GPT-NeoX's MLP size F (default 4 x hidden_size): a plain MLP is F wide; a gated one (swiglu,
    geglu, ...) has a first projection of int(2F/3) rows and halves of int(2F/3) // 2, so a Llama
    MLP with halves of w is F = 3w (docs/gpt_neox_semantics.md)."""

    mlp_multiple_of: int = Field(1, ge=1)
    """Round the MLP's first projection up to a multiple of twice this, its second projection's input
    to a multiple of this (GPT-NeoX's rule; widths that no longer fit each other are refused)."""

    expansion_factor: float | None = Field(None, gt=0)
    """F = int(expansion_factor x hidden_size) when intermediate_size is not given (not both)."""

    num_attention_heads: int | None = Field(None, ge=1)
    """Number of query heads per attention layer."""

    num_kv_heads: int | None = Field(None, ge=1)
    """Number of key/value heads for grouped-query attention; unset means one per query head (plain
    multi-head attention)."""

    kv_channels: int | None = Field(None, ge=1)
    """Channels of each attention head (Megatron-LM's ``--kv-channels``, Hugging Face's ``head_dim``): the
    query/key/value projection is (num_attention_heads + 2 num_kv_heads) x kv_channels wide, the output
    projection reads num_attention_heads x kv_channels, rotary turns int(kv_channels x rotary_pct) of each head.
    Unset: hidden_size / num_attention_heads (GPT-NeoX ea7aefd8 has no such key and always uses that).
    Qwen3, Gemma and Phi-3 models give their own."""

    seq_length: int | None = Field(None, ge=1)
    """Number of tokens in one training sample."""

    sliding_window_width: int | None = Field(None, ge=1)
    """Attend only to this many previous tokens (Mistral-style local attention); unset attends to
    the whole context."""

    max_position_embeddings: int | None = Field(None, ge=1)
    """Longest sequence the positional embedding supports; defaults to seq_length."""

    norm: str = needs_gpu_library("layernorm", TRANSFORMER_ENGINE, values=("te_rmsnorm", "te_layernorm"))
    """Normalisation layer used in every block and before the output layer: layernorm, rmsnorm,
    gemma_rmsnorm (Gemma's x / rms(x) * (1 + w), w from zeros), scalenorm, non_parametric_layernorm,
    non_parametric_rmsnorm (x / rms(x), no gain: Levanter's use_layer_norm_weight false; not a GPT-NeoX norm),
    te_rmsnorm/te_layernorm (Transformer Engine's RMSNorm/LayerNorm kernels with rms_norm_epsilon/layernorm_epsilon,
    NVIDIA GPU only), or a plug-in's (``megatron/model/norms.py``)."""

    @field_validator("norm")
    @classmethod
    def _registered_norm(cls, value: str) -> str:
        return NORMS.validate(value)

    layernorm_fusion: bool = False
    """Performance hint: use a fused LayerNorm kernel where one exists; results are unchanged."""

    rmsnorm_fusion: bool = False
    """Performance hint: use a fused RMSNorm kernel where one exists; results are unchanged."""

    use_qk_layernorm: bool = False
    """Normalise queries and keys per head before the attention product, which steadies training at
    high learning rates."""

    qk_norm_scope: Literal["head", "projection"] = "head"
    """What use_qk_layernorm's query and key norms cover. head: each head's head_dim features, one norm for the
    queries and one for the keys, shared by all heads (Qwen3, Gemma 3; Deepy's use_qk_layernorm). projection:
    the whole query projection (heads x head_dim) and the whole key projection (kv heads x head_dim), one gain
    per feature, before the heads are split (OLMo 2: transformers 5.23.0 models/olmo2/modeling_olmo2.py:213-228);
    needs norm rmsnorm. Under tensor parallelism each rank holds its heads' gains and the sum of squares is
    reduced over the tensor-parallel group. Not a GPT-NeoX key."""

    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide the attention scores of block i (0-based) by i + 1, as GPT-2 and Levanter can."""

    layernorm_epsilon: float = Field(1e-05, gt=0)
    """Epsilon added to the variance inside LayerNorm."""

    rms_norm_epsilon: float = Field(1e-08, gt=0)
    """Epsilon added inside RMSNorm (LLaMA uses 1e-6, LLaMA-2 1e-5)."""

    scalenorm_epsilon: float = Field(1e-08, gt=0)
    """Epsilon guarding the division in ScaleNorm."""

    pos_emb: PositionEmbedding = "learned"
    """How token positions enter the model: learned table, rotary (RoPE), sinusoidal, relative bias
    (rpe), ALiBi, or none."""

    rpe_num_buckets: int = Field(32, ge=1)
    """Number of relative-distance buckets for the T5-style relative position bias (pos_emb rpe)."""

    rpe_max_distance: int = Field(128, ge=1)
    """Distance beyond which relative positions share the last bucket (pos_emb rpe)."""

    opt_pos_emb_offset: int = Field(0, ge=0)
    """Offset added to position ids before the learned-embedding lookup; OPT checkpoints use 2."""

    no_weight_tying: bool = False
    """Give the output layer its own weights instead of reusing the input embedding matrix."""

    attention_config: list[Any] | None = None
    """Attention type of every layer as [[types, repeat], ...]: each entry's types repeated `repeat`
    times (or "all" to fill num_layers), e.g. [[["global"], 12]]; the layers must add up to
    num_layers. Unset means global attention everywhere."""

    sparsity_config: dict[str, Any] | None = obsolete(None, SPARSE_ATTENTION_GONE)
    """Settings of DeepSpeed's block-sparse attention kernels (attention types sparse_fixed, sparse_variable,
    bigbird, bslongformer), which DeepSpeed 0.19.8 no longer has."""

    num_unique_layers: int | None = Field(None, ge=1)
    """Build the num_layers blocks from this many parameter sets (it must divide num_layers): blocks that share a
    set are one module, run at each of its positions, their gradients summed. Unset: every block its own.
    GPT-NeoX declares and checks the key but builds nothing from it (docs/model_options.md)."""

    param_sharing_style: Literal["grouped", "spread", "spaced"] = "grouped"
    """Order of the shared parameter sets over the blocks, e.g. 4 blocks from 2 sets: grouped [1, 2, 1, 2],
    spread (GPT-NeoX's help text says spaced, also accepted) [1, 1, 2, 2]."""

    activation: Activation = "gelu"
    """Non-linearity of the MLP; the *glu variants gate one projection with another."""

    mlp_type: Literal["regular", "llama"] = "regular"
    """GPT-NeoX's spelling of a gated MLP before September 2024, kept so its Llama/Mistral configs of
    that time load: `llama` gates with `activation` (silu -> swiglu, gelu -> geglu, relu -> reglu),
    has no MLP biases, and each half is intermediate_size wide as given (not GPT-NeoX's current
    rule), or 8/3 x hidden_size rounded up to 256."""

    use_flashattn_swiglu: bool = False
    """Performance hint: use flash-attn's fused SwiGLU kernel where available; results are
    unchanged."""

    scaled_upper_triang_masked_softmax_fusion: bool = False
    """Performance hint: fuse scale, causal mask and softmax in one kernel; same results."""

    scaled_masked_softmax_fusion: bool = False
    """Performance hint: fuse scale, arbitrary mask and softmax in one kernel; results are
    unchanged."""

    bias_gelu_fusion: bool = False
    """With activation gelu, GPT-NeoX's fused bias+GeLU kernel, which computes GeLU's tanh approximation
    (not the exact erf GeLU): Deepy computes the same function (activation gelu_tanh)."""

    bias_dropout_fusion: bool = False
    """Performance hint: fuse bias add, dropout and residual add; results are unchanged."""

    rope_fusion: bool = False
    """Performance hint: apply rotary embeddings with a fused kernel; results are unchanged."""

    fused_kernels_build_path: str | None = None
    """Where compiled fused kernels are cached; unused when the kernels come from torch itself."""

    fp16_lm_cross_entropy: bool = False
    """Language modelling: compute each token's cross-entropy from the fp16 logits in fp16, as GPT-NeoX's
    vocab-parallel cross-entropy does without its fp32 upcast (saves memory, costs accuracy); needs precision
    fp16. False computes it in fp32."""

    init_method_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal initialisers."""

    apply_query_key_layer_scaling: bool = False
    """Divide attention scores by the layer number before softmax and multiply back after, to avoid
    fp16 overflow in deep models."""

    use_cpu_initialization: bool = False
    """Create weights in CPU memory before moving them to the device; Deepy always builds full
    weights from the seed and then shards them, so only where they are built changes."""

    attention_softmax_in_fp32: bool = False
    """Run the attention softmax in fp32 even when training in half precision."""

    rotary_pct: float = Field(1.0, gt=0, le=1)
    """Share of each head's dimensions that rotary embeddings rotate (Pythia and GPT-NeoX-20B use
    0.25)."""

    rotary_emb_base: int = Field(10000, ge=1)
    """Base of the rotary frequencies (theta); larger values stretch the usable context."""

    rope_scaling: dict[str, Any] | None = None
    """Deepy addition (Hugging Face's field): stretch rotary positions for a longer context, e.g.
    `{rope_type: linear, factor: 4}`; types linear, dynamic, yarn, llama3 with HF's fields."""

    rotary_save_freqs_buffer: bool = False
    """Store the rotary frequency table in the checkpoint instead of recomputing it on load."""

    rope_local_base_freq: int | None = Field(None, ge=1)
    """Rotary base of the sliding-window (local) layers of attention_config; the other layers keep
    rotary_emb_base, and rope_scaling applies to them only (Gemma 3: transformers 5.23.0
    models/gemma3/configuration_gemma3.py:143-156, the sliding layers' rope_parameters, and modeling_gemma3.py:549-556;
    Levanter's Gemma3Config.rope_local_base_freq, gemma.py:801-807@9263f81e). None: every layer uses
    rotary_emb_base. Not a GPT-NeoX key (HF's name)."""

    query_pre_attn_scalar: float | None = Field(None, gt=0)
    """Scale the attention scores by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5 (Gemma 2/3:
    transformers 5.23.0 models/gemma2/modeling_gemma2.py:221, scaling = config.query_pre_attn_scalar**-0.5).
    None: 1/sqrt(head_dim). Not with use_mup (its own 1/head_dim scale). Not a GPT-NeoX key (HF's name)."""

    attn_logit_softcapping: float | None = Field(None, gt=0)
    """Cap the attention scores softly, c * tanh(scores / c), after their scaling and before the causal mask
    and softmax (Gemma 2: transformers 5.23.0 models/gemma2/modeling_gemma2.py:193-203). The scores are then
    computed outside torch's fused attention kernels (the [b, heads, s, s] probabilities are kept for the
    backward, as the memory estimate counts). None: no cap. Not a GPT-NeoX key (HF's name)."""

    final_logit_softcapping: float | None = Field(None, gt=0)
    """Cap the output logits softly, c * tanh(logits / c), before the loss and sampling (Gemma 2:
    transformers 5.23.0 models/gemma2/modeling_gemma2.py:517-521). None: no cap. Not a GPT-NeoX key (HF's name)."""

    scale_embeddings_by_sqrt_hidden: bool = False
    """Multiply the token embeddings by sqrt(hidden_size), the factor rounded to the embeddings' dtype first
    (Gemma: transformers 5.23.0 models/gemma2/modeling_gemma2.py:330-341, 378-381, embed_scale.to(weight.dtype);
    Levanter gemma.py:425-426@9263f81e). The tied output layer reads the unscaled table. Not a GPT-NeoX key."""

    init_method: InitMethod = "normal"
    """Initialiser of most weight matrices."""

    output_layer_init_method: InitMethod = "scaled_normal"
    """Initialiser of the projections that write into the residual stream (attention output, MLP
    down-projection)."""

    gmlp_attn_dim: int = Field(64, ge=1)
    """Width of the one-head attention inside `amlp` (gMLP) blocks; `gmlp` blocks have none."""

    gpt_j_residual: bool = False
    """Run attention and MLP in parallel from the same input and add both to the residual (GPT-J,
    Pythia, NeoX-20B)."""

    gpt_j_tied: bool = False
    """With gpt_j_residual, feed attention and MLP from one shared LayerNorm instead of two."""

    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where a block's norms sit. pre: before attention and before the MLP, x + attn(norm(x)) (GPT-NeoX's only
    placement, ea7aefd8 megatron/model/transformer.py:1118-1230). post: after them, x + norm(attn(x)), no norm
    before (OLMo 2: transformers 5.23.0 models/olmo2/modeling_olmo2.py:297-314). sandwich: both, x +
    norm(attn(norm(x))) (Gemma 2/3: models/gemma2/modeling_gemma2.py:305-325). The final norm before the output layer
    stays in every placement. Not a GPT-NeoX key; not with gpt_j_residual."""

    use_bias_in_norms: bool = True
    """Give the norm layers an additive bias (LLaMA-style models have none)."""

    use_bias_in_attn_linear: bool = True
    """Give the attention projections a bias."""

    use_bias_in_qkv: bool = False
    """Give the fused query/key/value projection a bias even with use_bias_in_attn_linear false, the attention
    output projection none (Qwen2: transformers 5.23.0 models/qwen2/modeling_qwen2.py:181-184, bias=True on
    q_proj/k_proj/v_proj, False on o_proj). Not a GPT-NeoX key (ea7aefd8 has one bias switch for both
    projections); with use_bias_in_attn_linear true it changes nothing."""

    use_bias_in_mlp: bool = True
    """Give the MLP projections a bias."""

    soft_prompt_tuning: dict[str, Any] | None = None
    """Train only a learned prompt of n_tokens vectors placed before every sample's embedded tokens; every other weight
    is frozen. Entries as GPT-NeoX's code reads them: enabled (default false), n_tokens (10), init_string (start from
    its tokens' embeddings) or init_range (else uniform in +-init_range, 0.5) (docs/model_options.md)."""

    mamba_selective_scan_fusion: bool = False
    """Mamba layers: run the selective scan with the `mamba_ssm` package's CUDA kernel instead of the
    PyTorch scan (same maths; needs the package and an NVIDIA GPU)."""

    mamba_causal_conv_fusion: bool = False
    """Mamba layers: run the causal 1-D convolution with the `causal_conv1d` package's CUDA kernel (same
    maths; needs the package and an NVIDIA GPU)."""

    mamba_inner_func_fusion: bool = False
    """Mamba layers: run everything after the input projection as `mamba_ssm`'s one fused function
    (needs `mamba_ssm` and `causal_conv1d` on an NVIDIA GPU; one tensor-parallel rank, no biases in the
    projections)."""

    mamba_selective_fp32_params: bool = True
    """Mamba layers: keep A_log and D in fp32 when the rest of the model is fp16/bf16; false stores them in the
    model's dtype like every other weight (the scan computes in fp32 either way). Training in fp16/bf16 keeps them
    fp32 only with GPT-NeoX's DeeperSpeed: DeepSpeed 0.19.8 casts every parameter, so set true there is refused and
    the default is warned about (docs/model_options.md)."""

    mamba_use_bias_in_conv: bool = True
    """Mamba layers: give the causal convolution a bias."""

    mamba_use_bias_in_linears: bool = False
    """Mamba layers: give the input, B/C/step-size and output projections a bias."""

    output_layer_parallelism: Literal["column"] = "column"
    """How the output layer is split across tensor-parallel ranks; only column (vocabulary)
    splitting exists."""

    te_columnparallel: bool = needs_gpu_library(False, TRANSFORMER_ENGINE)
    """Build each block's column-parallel linear layers (QKV, MLP input) as Transformer Engine's Linear with
    parallel_mode "column" (GPT-NeoX ea7aefd8 get_parallel_linear; Deepy's untied output layer stays its own)."""

    te_rowparallel: bool = needs_gpu_library(False, TRANSFORMER_ENGINE)
    """Build every row-parallel linear layer (attention output, MLP output) as Transformer Engine's Linear with
    parallel_mode "row"."""

    te_layernorm_mlp: bool = needs_gpu_library(False, TRANSFORMER_ENGINE)
    """Replace each dense block's post-attention norm and MLP by Transformer Engine's fused LayerNormMLP
    (LayerNorm or RMSNorm as `norm` says, GPT-NeoX's activations gelu/geglu/relu/reglu/squared_relu/swiglu/
    qgelu/srelu); MoE blocks keep their experts."""

    te_mha: bool = needs_gpu_library(False, TRANSFORMER_ENGINE)
    """Build each block's self-attention as Transformer Engine's MultiheadAttention (fused QKV, causal
    flash/fused attention, rotary and sliding window as configured)."""

    te_fp8_format: Literal["e4m3", "hybrid"] = needs_gpu_library("hybrid", TRANSFORMER_ENGINE)
    """FP8 format of the te_fp8_mha recipe: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)."""

    te_fp8_wgrad: bool = needs_gpu_library(True, TRANSFORMER_ENGINE)
    """te_fp8_mha recipe: compute weight gradients in FP8 too; false keeps them in higher precision."""

    te_fp8_amax_history_len: int = needs_gpu_library(1, TRANSFORMER_ENGINE)
    """te_fp8_mha recipe: how many steps of amax (absolute maxima) the FP8 scales are computed from."""

    te_fp8_amax_compute_algo: Literal["most_recent", "max"] = needs_gpu_library("most_recent", TRANSFORMER_ENGINE)
    """te_fp8_mha recipe: scale from the most recent amax or the largest in the history."""

    te_fp8_margin: int = needs_gpu_library(0, TRANSFORMER_ENGINE)
    """te_fp8_mha recipe: FP8 scales are divided by 2**margin, headroom against overflow."""

    te_fp8_mha: bool = needs_gpu_library(False, TRANSFORMER_ENGINE)
    """Run every transformer block under Transformer Engine's fp8_autocast with a DelayedScaling recipe built
    from the te_fp8_* keys (fp8_mha: FP8 attention too); implies te_mha, as in GPT-NeoX."""

    dim_att: int | None = Field(None, ge=1)
    """RWKV: width of the time-mixing (attention) layer; unset means hidden_size."""

    head_size: int | None = Field(None, ge=1)
    """RWKV: channels per head; GPT-NeoX derives it as dim_att / num_attention_heads, so a value is
    accepted only when it equals that."""

    ffn_dim: int | None = Field(None, ge=1)
    """RWKV: width of the channel-mixing layer; GPT-NeoX derives it from intermediate_size or
    expansion_factor (3.5 x hidden_size), rounded down to a multiple of 32, so a value is accepted only
    when it equals that."""

    rwkv_wkv_fusion: bool = False
    """Deepy addition: run RWKV-6's WKV recurrence with the `flash-linear-attention` package's fused
    kernel (`fla`, an NVIDIA GPU) instead of the PyTorch chunked recurrence; same maths."""

    attention_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on attention probabilities."""

    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on attention and MLP outputs before they join the residual."""

    padded_vocab_size: int | None = Field(None, ge=1)
    """Rows of the embedding and output layer; unset means the tokenizer's vocabulary padded to a
    multiple of make_vocab_size_divisible_by x the tensor-parallel size (computed at runtime)."""

    seed: int = Field(1234, ge=0)
    """Seed for weights, data order and dropout; the same seed gives the same run on any layout."""

    sequence_parallel: bool = False
    """Split layer-norm and dropout activations along the sequence across tensor-parallel ranks to
    save memory."""

    _value_head: bool = PrivateAttr(default=False)  # not a key: the objective's choice (`value_head`)

    @field_validator("attention_config")
    @classmethod
    def _attention_config_shape(cls, value: list[Any] | None) -> list[Any] | None:
        """Check the NeoX shape ``[[types, repeat], ...]`` and the type names.

        Whether the repeats add up to ``num_layers`` is a cross-field rule checked later; here
        only what one field can tell: each entry is a list of known type names and a count.
        """
        if value is None:
            return value
        for entry in value:
            ok = (
                isinstance(entry, (list, tuple))
                and len(entry) == 2
                and isinstance(entry[0], (list, tuple))
                and len(entry[0]) > 0
                and all(isinstance(t, str) for t in entry[0])
                and ((isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 1)
                     or entry[1] == "all")
            )
            if not ok:
                raise ValueError(
                    f"entry {entry!r} should be [[type, ...], repeat] with repeat a count or \"all\", "
                    f"e.g. [[\"global\"], 12]"
                )
            unknown = sorted(set(entry[0]) - KNOWN_ATTENTION_TYPES)
            if unknown:
                known = ", ".join(sorted(KNOWN_ATTENTION_TYPES))
                raise ValueError(f"unknown attention type(s) {', '.join(unknown)}; known: {known}")
        return value

    # --- what is not a key ----------------------------------------------------------------
    @property
    def value_head(self) -> bool:
        """One scalar per token instead of logits (``train_impl: rm``): ``replace(value_head=True)``, no key."""
        return self._value_head

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype the weights are created in: ``precision`` (fp32 when unset)."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        import torch

        return getattr(torch, _DTYPE_NAMES[self.precision or "fp32"])

    @property
    def norm_settings(self) -> NormSettings:
        """What the ``norm`` entry builds and counts from (its epsilons, bias and dtype), as plain values."""
        return NormSettings(norm=self.norm, hidden_size=self.hidden_size, layernorm_epsilon=self.layernorm_epsilon,
                            rms_norm_epsilon=self.rms_norm_epsilon, scalenorm_epsilon=self.scalenorm_epsilon,
                            use_bias_in_norms=self.use_bias_in_norms, dtype_name=_DTYPE_NAMES[self.precision or "fp32"])

    def keys_without_effect(self) -> frozenset[str]:
        """Keys whose value changes nothing in this model: the norm keys its ``norm`` entry does not read
        (``use_bias_in_norms`` and ``layernorm_epsilon`` for rmsnorm, ``NormEntry.reads``). Two configs
        that differ only in these build the same weights and compute the same function."""
        if self.norm not in NORMS:  # a plug-in's norm not registered in this process: every key counts
            return frozenset()
        return frozenset(NORM_KEYS) - frozenset(NORMS[self.norm].reads)

    def differences(self, other: GPTConfig) -> list[str]:
        """``key: mine -> other's`` for every key in which ``other`` describes another model (the keys of
        :meth:`keys_without_effect` in both left out)."""
        inert = self.keys_without_effect() & other.keys_without_effect()
        mine, theirs = self.model_dump(), other.model_dump()
        found = [f"{key}: {mine.get(key)!r} -> {theirs.get(key)!r}" for key in sorted(mine.keys() | theirs.keys())
                 if key not in inert and mine.get(key) != theirs.get(key)]
        if self._value_head != other._value_head:
            found.append(f"value head: {self._value_head} -> {other._value_head}")
        return found

    @property
    def arch(self) -> Architecture:
        """The resolved sizes (:class:`Architecture`); a :class:`ModelConfigError` naming the key left unset."""
        layers, hidden, heads = self.num_layers, self.hidden_size, self.num_attention_heads
        if layers is None or hidden is None or heads is None:
            missing = [key for key in ("num_layers", "hidden_size", "num_attention_heads") if getattr(self, key) is None]
            raise ModelConfigError(f"{', '.join(missing)} must be set: the model is built from them")
        return Architecture(layers, hidden, heads)

    @property
    def vocab(self) -> int:
        """``padded_vocab_size``, once set (:meth:`for_tokenizer`); a :class:`ModelConfigError` before."""
        if self.padded_vocab_size is None:
            raise ModelConfigError("padded_vocab_size is not set: size the model for its tokenizer (for_tokenizer)")
        return self.padded_vocab_size

    @property
    def max_positions(self) -> int:
        """Learned position rows / rotary scaling's context: ``max_position_embeddings``, else ``seq_length``."""
        value = self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length
        assert value is not None, "check_architecture() first"
        return value

    @property
    def rope_scaling_spec(self) -> RopeScaling | None:
        """``rope_scaling`` (HF's dict) parsed (``megatron/model/rope_scaling.py``)."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        from megatron.model.rope_scaling import parse_rope_scaling

        return parse_rope_scaling(self.rope_scaling, self.max_positions) if self.rope_scaling else None

    def check_architecture(self) -> None:
        """Raise :class:`ModelConfigError` for an architecture the model cannot build; the model and
        the pipeline builder call it first."""
        # the same checks deepy.py runs before launch (megatron/model/checks.py), one invariant written once
        view = ConfigView(self)
        problems: list[str] = []
        for shape_check in (checks.model_shape_given, checks.heads_divide_hidden, checks.kv_heads_fit,
                            checks.rope_scaling_is_honoured, moe_checks.moe_top_k_fits, checks.mlp_widths_fit,
                            checks.rotary_dims_even, checks.parallel_residual_keeps_attention,
                            checks.positions_fit_the_learned_table, checks.fused_gelu_has_a_bias,
                            checks.rpe_distance_exceeds_half_the_buckets, checks.local_attention_has_a_window,
                            checks.norm_placement_and_qk_norm_scope_fit):
            problems += shape_check(view)
        if problems:
            raise ModelConfigError("; ".join(problems))
        self._check_choices()
        bad = [t for t in self.attention_types if t not in ATTENTION_TYPES and t not in FAMILY_OF_TYPE]
        if bad:
            raise ModelConfigError(f"attention types {sorted(set(bad))} are not supported (only "
                                   f"{', '.join([*ATTENTION_TYPES, *sorted(FAMILY_OF_TYPE)])})")
        problems = family_checks.shape_problems(view)  # the Mamba/RWKV/gMLP layers' own shape rules
        if problems:
            raise ModelConfigError("; ".join(problems))

    def _check_choices(self) -> None:
        choices: dict[str, tuple[str, list[str]]] = {
            "pos_emb": (self.pos_emb, list(POSITIONAL)),
            "norm": (self.norm, sorted(NORMS)),
            "activation": (self.activation, sorted(ACTIVATIONS)),
            "init_method": (self.init_method, list(_INIT_METHODS)),
            "output_layer_init_method": (self.output_layer_init_method, list(_INIT_METHODS)),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ModelConfigError(f"{key}={value!r} is not supported; choose one of {allowed}")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, else hidden_size / num_attention_heads."""
        return self.kv_channels if self.kv_channels is not None else self.arch.hidden // self.arch.heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or one per query head when unset."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.arch.heads

    @property
    def qkv_bias(self) -> bool:
        """The fused QKV projection has a bias: ``use_bias_in_attn_linear`` or ``use_bias_in_qkv`` (Qwen2)."""
        return self.use_bias_in_attn_linear or self.use_bias_in_qkv

    @property
    def mlp_widths(self) -> MLPWidths:
        """The dense MLP's two widths by GPT-NeoX's rules (``megatron/model/mlp_width.py``)."""
        return MLP_TYPES[self.mlp_type].widths(self, is_gated(self.activation))

    @property
    def ffn_hidden_size(self) -> int:
        """MLP width after the activation (each half of the first projection when gated)."""
        return self.mlp_widths.second

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation as GPT-NeoX runs it: ``bias_gelu_fusion`` makes gelu the tanh
        approximation (its ``bias_gelu`` kernel, activations.py:45-53, 78-81 at ea7aefd8)."""
        return "gelu_tanh" if self.activation == "gelu" and self.bias_gelu_fusion else self.activation

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One expert's width (each half when gated) in an MoE layer: GPT-NeoX's expert rule."""
        if self.mlp_type == "llama":
            return self.ffn_hidden_size
        return expert_width(self.arch.hidden, self.intermediate_size)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether block `layer_number` (0-based) has an MoE layer instead of the dense MLP (GPT-NeoX's rule)."""
        return self.moe_num_experts > 1 and layer_number % max(1, self.moe_expert_interval) == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.arch.layers))

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary rotates."""
        # GPT-NeoX: the whole head at rotary_pct 1, else int(head_dim * rotary_pct); an odd count is
        # refused (checks.rotary_dims_even)
        return self.head_dim if self.rotary_pct == 1 else int(self.head_dim * self.rotary_pct)

    @property
    def attention_types(self) -> list[str]:
        """One attention type per layer (see :func:`expand_attention_config`)."""
        if not self.attention_config:
            return ["global"] * self.arch.layers
        return expand_attention_config(self.attention_config, self.arch.layers)

    @property
    def layer_families(self) -> set[FamilyName]:
        """The families of this model's layers: ``transformer`` (attention + MLP), ``mamba``, ``rwkv``, ``gmlp``."""
        return {family_of(t) for t in self.attention_types}

    def tensor_parallel_splits(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """What tensor parallelism splits in this model: name -> (size, the keys that set it). The embedding rows
        (``padded_vocab_size``) only once the vocabulary is sized."""
        splits: dict[str, tuple[int, tuple[str, ...]]] = {}
        if self.padded_vocab_size is not None:
            splits["padded_vocab_size"] = (self.padded_vocab_size, ("padded_vocab_size",))
        if "transformer" in self.layer_families:
            splits.update({
                "num_attention_heads": (self.arch.heads, ("num_attention_heads",)),
                "num_kv_heads": (self.kv_heads, ("num_kv_heads", "num_attention_heads")),
            })
            if self.num_moe_layers < self.arch.layers:  # a dense MLP is built somewhere (Mixtral's: nowhere)
                splits["the MLP width (GPT-NeoX's rule: intermediate_size, expansion_factor, mlp_multiple_of)"] = (
                    self.ffn_hidden_size, MLP_WIDTH_KEYS)

        splits.update(tensor_parallel_splits(self))
        if self.moe_num_experts > 1:
            splits["moe_num_experts (each tp rank holds whole experts)"] = (self.moe_num_experts, ("moe_num_experts",))
        return splits

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise if the architecture cannot be built (``check_architecture``), if the vocabulary is not
        sized yet, or if the sizes that tensor parallelism splits do not divide by `tp` (before launch:
        :func:`sizes_split_over_tensor_parallel` and the rules of heads, key/value heads, vocabulary and experts)."""
        self.check_architecture()
        self.vocab  # noqa: B018  # sized (for_tokenizer) before any layer splits it
        bad = [f"{key}={value}" for key, (value, _) in self.tensor_parallel_splits().items() if value % tp != 0]
        if bad:
            raise ModelConfigError(
                f"tensor parallelism splits these across {tp} ranks, but they are not divisible by {tp}: "
                + ", ".join(bad)
            )

    def local_rotary(self, layer_number: int) -> bool:
        """Whether this layer takes ``rope_local_base_freq`` (set, and the layer's attention type is local)."""
        return self.rope_local_base_freq is not None and self.attention_types[layer_number] in _LOCAL_ATTENTION

    def rotary_base(self, layer_number: int) -> int:
        """Rotary base of this layer: ``rope_local_base_freq`` on a local layer when set (Gemma 3), else
        ``rotary_emb_base``."""
        local = self.rope_local_base_freq if self.local_rotary(layer_number) else None
        return self.rotary_emb_base if local is None else local

    def rotary_scaling(self, layer_number: int) -> RopeScaling | None:
        """``rope_scaling`` of this layer: none on the layers ``rope_local_base_freq`` gives their own base
        (Gemma 3 scales its global layers only: transformers 5.23.0 configuration_gemma3.py:143-144)."""
        return None if self.local_rotary(layer_number) else self.rope_scaling_spec

    def attention_window(self, layer_number: int) -> int | None:
        """Sliding-window width of this layer's attention, or None for full causal attention."""
        types = self.attention_types
        if any(t in _LOCAL_ATTENTION for t in types):
            return self.sliding_window_width if types[layer_number] in _LOCAL_ATTENTION else None
        return self.sliding_window_width

    def init_fn(self) -> InitFn:
        """Init for input-side weights (embeddings, QKV, first MLP projection, untied output)."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        from megatron.mpu.initialize_weights import init_method_from_name

        return init_method_from_name(self.init_method, self.init_method_std, self.arch.layers, self.arch.hidden)

    def output_init_fn(self) -> InitFn:
        """Init for the layers that write into the residual stream (attention dense, MLP out)."""
        # lazy: torch; the launcher (deepy.py) reads this module without it
        from megatron.mpu.initialize_weights import init_method_from_name

        return init_method_from_name(
            self.output_layer_init_method, self.init_method_std, self.arch.layers, self.arch.hidden
        )

    # --- variants -----------------------------------------------------------------------
    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (GPT-NeoX key names, or ``value_head``); the original is untouched."""
        value_head = bool(changes.pop("value_head", self._value_head))
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no keys {unknown}")
        copy = self.model_copy(update=changes)
        copy._value_head = value_head
        return copy

    def with_vocab(self, padded_vocab_size: int) -> Self:
        """The same architecture with ``padded_vocab_size`` embedding rows."""
        return self.replace(padded_vocab_size=padded_vocab_size)

    def for_tokenizer(self, padded_vocab: int) -> Self:
        """This architecture sized for the tokenizer: the config's ``padded_vocab_size`` when given (the
        rules check it divides over tp), else ``padded_vocab`` (``TokenizerArgs.padded``)."""
        return self.with_vocab(self.padded_vocab_size or padded_vocab)


def expand_attention_config(config: list[Any], num_layers: int) -> list[str]:
    """GPT-NeoX's ``[[types, repeat], ...]`` as one type per layer (:func:`megatron.model.family_config.expand_layer_types`)."""
    try:
        return expand_layer_types(config, num_layers)
    except ValueError as err:
        raise ModelConfigError(str(err)) from None


@rule
def attention_config_covers_layers(ctx: RuleContext) -> list[str]:
    """Before launch (registered with the other checks): the layers :func:`expand_attention_config` gives
    the model cover num_layers."""
    config, layers = ctx.get("attention_config"), ctx.get("num_layers")
    if not config or layers is None:
        return []
    try:
        expand_attention_config(config, layers)
    except ModelConfigError as err:
        return [f"{err.message} ({describe(ctx.source('attention_config'))}, num_layers at "
                f"{describe(ctx.source('num_layers'))})"]
    return []


MLP_WIDTH_KEYS = ("hidden_size", "intermediate_size", "expansion_factor", "mlp_multiple_of", "activation", "mlp_type")
"""The keys GPT-NeoX's MLP width rule reads (``megatron/model/mlp_width.py``)."""

OWN_RULES = {
    "padded_vocab_size": "vocab_padding_splits_over_tp",
    "num_attention_heads": "heads_divide_over_tp",
    "num_kv_heads": "kv_heads_fit",
    "moe_num_experts (each tp rank holds whole experts)": "moe_experts_split_evenly",
}
"""Splits whose own rule (``model/checks.py``, ``model/moe_checks.py``) says what to change."""


@rule
def sizes_split_over_tensor_parallel(ctx: RuleContext) -> list[str]:
    """What the layers refuse when they are built (:meth:`GPTConfig.check_tensor_parallel`), before launch: each
    size tensor parallelism splits (the MLP width by GPT-NeoX's rule, a Mamba or gMLP layer's inner width)
    divides by model_parallel_size. A model the shape rules refuse is left to them."""
    tp = ctx.tp
    if tp <= 1:
        return []
    config = ctx.group(GPTConfig)
    try:
        config.check_architecture()
        splits = config.tensor_parallel_splits()
    except (ConfigError, ValueError, TypeError):
        return []  # the shape rules name what is missing or wrong

    def sources(keys: tuple[str, ...]) -> str:
        return ", ".join(ctx.show(key) for key in keys if key == "hidden_size" or ctx.given(key))

    return [f"{ctx.show('model_parallel_size')} splits {name} = {size} over {tp} ranks, but {size} is not divisible "
            f"by {tp} (it follows from {sources(keys)}): choose sizes that give a multiple of {tp}, or a "
            f"model_parallel_size that divides {size}"
            for name, (size, keys) in splits.items() if name not in OWN_RULES and size % tp != 0]
