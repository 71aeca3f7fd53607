"""Levanter's ``model:`` section: its ``LmConfig`` classes as GPT-NeoX model keys.

Defaults and meanings are read from stanford-crfm/levanter at 9263f81e: ``Gpt2Config``
(``src/levanter/models/gpt2.py``), ``LlamaConfig`` (``llama.py``), ``MistralConfig`` (``mistral.py``), the
rotary configs (``src/levanter/layers/rotary.py``) and ``TrainLmConfig`` (``src/levanter/main/train_lm.py``,
whose default model is a ``LlamaConfig``). Model types Deepy does not build are refused by name.
"""

from __future__ import annotations

from typing import Any

from megatron.model.mlp_width import intermediate_size_for
from megatron.neox_arguments.dialects import levanter_sft
from megatron.neox_arguments.dialects.common import NOTE, Context, Refused, Rule, noted, to

DEFAULT_TYPE = "llama"
"""``TrainLmConfig.model`` defaults to ``LlamaConfig``."""

_RMS = dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu", no_weight_tying=True,
            use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False, init_method_std=0.02,
            rotary_emb_base=10000, checkpoint_activations=True)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Gpt2Config: GPT-2 small, learned positions, LayerNorm, gelu_new, tied embeddings, MLP 4 x hidden,
    # biases, gradient_checkpointing on
    "gpt2": dict(pos_emb="learned", norm="layernorm", activation="gelu_tanh", no_weight_tying=False,
                 hidden_size=768, intermediate_size=4 * 768, num_attention_heads=12, num_layers=12, seq_length=1024,
                 max_position_embeddings=1024, layernorm_epsilon=1e-5, init_method_std=0.02,
                 use_bias_in_attn_linear=True, use_bias_in_mlp=True, checkpoint_activations=True),
    # (a gated MLP whose halves are W wide is GPT-NeoX's intermediate_size 3W: model/mlp_width.py)
    # LlamaConfig: Llama-2 7B shapes, 32 kv heads (whatever num_heads is), RMSNorm eps 1e-5, untied
    "llama": dict(_RMS, hidden_size=4096, intermediate_size=3 * 11008, num_attention_heads=32, num_kv_heads=32,
                  num_layers=32, seq_length=2048, max_position_embeddings=2048, rms_norm_epsilon=1e-5),
    # MistralConfig: Mistral 7B shapes, 8 kv heads, RMSNorm eps 1e-6 (its sliding_window is only written
    # into exported HF configs: Levanter's attention is full causal)
    "mistral": dict(_RMS, hidden_size=4096, intermediate_size=3 * 14336, num_attention_heads=32, num_kv_heads=8,
                    num_layers=32, seq_length=8192, max_position_embeddings=8192, rms_norm_epsilon=1e-6),
    # QwenConfig (qwen.py:35-48, 125-139@9263f81e; Qwen 2): LlamaConfig's defaults (Llama-2 7B shapes, eps 1e-5,
    # untied, rope theta 1e4) with biases on q/k/v always and none on o_proj (attention_config, :131-133), the
    # MLP's bias from use_bias (:159, default False)
    "qwen": dict(_RMS, hidden_size=4096, intermediate_size=3 * 11008, num_attention_heads=32, num_kv_heads=32,
                 num_layers=32, seq_length=2048, max_position_embeddings=2048, rms_norm_epsilon=1e-5,
                 use_bias_in_qkv=True),
    # Qwen3Config (qwen.py:299-376): LlamaConfig's defaults with an RMSNorm (eps layer_norm_epsilon) over each head's
    # queries and keys (qk_norm = norm_config, :374-376, built over HeadSize and applied before rope:
    # layers/attention.py:1492-1494, 1622-1633); all four attention projections' biases from use_bias (default False)
    "qwen3": dict(_RMS, hidden_size=4096, intermediate_size=3 * 11008, num_attention_heads=32, num_kv_heads=32,
                  num_layers=32, seq_length=2048, max_position_embeddings=2048, rms_norm_epsilon=1e-5,
                  use_qk_layernorm=True),
    # MixtralConfig (mixtral.py:65-90@9263f81e): Mistral's shapes with every MLP a mixture of 8 SwiGLU experts
    # of 14336 (GPT-NeoX's expert rule: intermediate_size is each half's width, model/mlp_width.py), top-2
    # routing renormalised over the two (_route, mixtral.py:344-345), rope theta 1e4 (not HF's 1e6); its
    # balance loss lbl_coef x (E/k) sum_e load_e P_e is Deepy's E sum_e load_e P_e times lbl_coef / k
    # (mixtral.py:459-462), its router z-loss rzl_coef x mean logsumexp^2 (463-466), both summed over layers
    "mixtral": dict(_RMS, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_kv_heads=8,
                    num_layers=32, seq_length=8192, max_position_embeddings=8192, rms_norm_epsilon=1e-6,
                    moe_num_experts=8, moe_top_k=2, moe_router_type="topk", moe_router_renormalize=True,
                    moe_expert_interval=1, moe_aux_loss_coeff=0.01 / 2, moe_z_loss_coeff=0.001),
    # Olmo2Config (olmo.py:35-95@9263f81e): OLMo-2 7B shapes, silu MLP without biases (use_bias, :75, 396-399), RMSNorm
    # eps 1e-6 after attention and after the MLP only (Olmo2DecoderLayer, :406-423), q_norm/k_norm over the whole
    # query/key projections (:312-314, 329-333), untied, no attention bias (:63), rope theta 1e4
    # (DefaultRotaryEmbeddingsConfig, rotary.py:76-78), gradient_checkpointing on (:72)
    "olmo2": dict(_RMS, hidden_size=4096, intermediate_size=3 * 11008, num_attention_heads=32, num_kv_heads=32,
                  num_layers=32, seq_length=4096, max_position_embeddings=4096, rms_norm_epsilon=1e-6,
                  norm_placement="post", use_qk_layernorm=True, qk_norm_scope="projection"),
    # GemmaConfig (gemma.py:61-122@9263f81e, Gemma 1, defaults for Gemma-2B): pre-norm blocks (GemmaDecoderLayer,
    # :294-335) with Gemma's (1 + w) RMSNorm in fp32 (GemmaRMSNorm, :259-291; eps 1e-5, :80), a gelu_new gated MLP
    # (LlamaMlp, :78, 309-315) without biases (:93), embeddings times sqrt(hidden_dim) in their dtype (:425-426),
    # 8 heads of 256 with one kv head (:88-90), tied embeddings (:81), scores by 1/sqrt(head_dim) (its
    # attention_config, :231-244, passes no query_pre_attn_scalar), rope theta 1e4, gradient_checkpointing on (:105)
    "gemma": dict(_RMS, norm="gemma_rmsnorm", activation="geglu_tanh", no_weight_tying=False,
                  scale_embeddings_by_sqrt_hidden=True, hidden_size=2048, intermediate_size=3 * 16384,
                  num_attention_heads=8, num_kv_heads=1, kv_channels=256, num_layers=18, seq_length=8192,
                  max_position_embeddings=8192, rms_norm_epsilon=1e-5),
    # Gemma2Config / Gemma3Config (gemma.py:453-480, 780-800@9263f81e): GemmaConfig's defaults (Gemma-2B's shapes,
    # not Gemma-2-2B's) in Gemma2Transformer's sandwich (Gemma2DecoderLayer, :599-660). What their model computes
    # (read from the code, not the docstrings): scores capped by attn_logit_softcapping (Gemma 2 only: 50, passed
    # as logits_soft_cap, :582-592; layers/attention.py:352-367 caps after the 1/sqrt(head_dim) scale, before the
    # mask), no query_pre_attn_scalar (AttentionConfig gets none), no final-logit cap (the LM heads never read
    # final_logit_softcapping, :706-760, 928-990), no sliding window and one rotary base (the windows, the pattern
    # and rope_local_base_freq reach only exported HF configs); Gemma 3: per-head q/k norms always (:907-918)
    "gemma2": dict(_RMS, norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh",
                   no_weight_tying=False, scale_embeddings_by_sqrt_hidden=True, hidden_size=2048,
                   intermediate_size=3 * 16384, num_attention_heads=8, num_kv_heads=1, kv_channels=256, num_layers=18,
                   seq_length=8192, max_position_embeddings=8192, rms_norm_epsilon=1e-5, attn_logit_softcapping=50.0),
    "gemma3": dict(_RMS, norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh",
                   no_weight_tying=False, scale_embeddings_by_sqrt_hidden=True, hidden_size=2048,
                   intermediate_size=3 * 16384, num_attention_heads=8, num_kv_heads=1, kv_channels=256, num_layers=18,
                   seq_length=8192, max_position_embeddings=8192, rms_norm_epsilon=1e-5, use_qk_layernorm=True),
}

NOT_BUILT = {
    "gpt2_hyena": "Hyena operators", "backpack": "Backpack sense vectors", "whisper": "an encoder-decoder speech model",
    "llama4": "Llama 4",
    "apertus": "Apertus", "mpt": "MPT", "gpt_oss": "gpt-oss",
}
"""Levanter's model types Deepy does not build, with what they need."""

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                "silu": "silu", "swish": "silu"}
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu", "gelu_new": "geglu_tanh",
          "gelu_pytorch_tanh": "geglu_tanh"}


def model_type(ctx: Context) -> str:
    kind = str(ctx.value("model.type", DEFAULT_TYPE)).lower()
    if kind in NOT_BUILT:
        raise Refused(f"model type {kind!r} ({NOT_BUILT[kind]}) is not built here; Deepy runs {', '.join(MODEL_PRESETS)}")
    if kind not in MODEL_PRESETS:
        raise Refused(f"unknown model type {kind!r}; Deepy runs {', '.join(MODEL_PRESETS)}")
    return kind


def shape_kind(ctx: Context) -> str:
    """The model type for shaping a key's value (``model.type``'s own rule refuses a type Deepy lacks)."""
    kind = str(ctx.value("model.type", DEFAULT_TYPE)).lower()
    return kind if kind in MODEL_PRESETS else DEFAULT_TYPE


def _model_type_rule(value: Any, ctx: Context) -> dict[str, Any]:
    model_type(ctx)  # checks the name; the preset itself is implied (explicit fields win)
    return {}


def _seq_len(value: Any, ctx: Context) -> dict[str, Any]:
    owner = levanter_sft.length_owner(ctx)  # sft.py and lora_lm.py set the trained length themselves
    if owner == "max_seq_len":
        return noted("sft.py with initialize_from_hf trains at max_seq_len (sft.py:123)")
    if owner == "max_train_length":
        return {"max_position_embeddings": value}
    return {"seq_length": value, "max_position_embeddings": value}


def _hidden_dim(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) == "gpt2" and "model.intermediate_dim" not in ctx.leaves:
        return {"hidden_size": value, "intermediate_size": int(ctx.value("model.mlp_scale", 4)) * int(value)}
    return {"hidden_size": value}


def _mlp_scale(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) != "gpt2":
        raise Refused("mlp_scale is a Gpt2Config field; llama/mistral give intermediate_dim")
    return {"intermediate_size": int(value) * int(ctx.value("model.hidden_dim", 768))}


def _activation(value: Any, ctx: Context) -> dict[str, Any]:
    name = _ACTIVATIONS.get(str(value))
    if name is None:
        raise Refused(f"activation_function {value!r} is not built here; use one of {', '.join(_ACTIVATIONS)}")
    if shape_kind(ctx) != "gpt2":  # Llama's MLP gates the activation
        gated = _GATED.get(str(value))
        if gated is None:
            raise Refused(f"a gated ({shape_kind(ctx)}) MLP gates silu, gelu or relu, not {value!r}")
        return {"activation": gated}
    return {"activation": name}


def _intermediate_dim(value: Any, ctx: Context) -> dict[str, Any]:
    """Levanter's width of each half of a gated MLP is GPT-NeoX's intermediate_size / 3
    (``megatron/model/mlp_width.py``); GPT-2's MLP is not gated."""
    if shape_kind(ctx) == "mixtral":  # every MLP is an expert: GPT-NeoX's expert width is intermediate_size
        return {"intermediate_size": int(value)}
    size = intermediate_size_for(int(value), gated=shape_kind(ctx) != "gpt2")
    if size is None:
        raise Refused(f"intermediate_dim {value}: GPT-NeoX's MLP rule builds no odd ungated width; use an even one")
    return {"intermediate_size": size}


def _layer_norm_epsilon(value: Any, ctx: Context) -> dict[str, Any]:
    return {"layernorm_epsilon" if shape_kind(ctx) == "gpt2" else "rms_norm_epsilon": value}


def _use_bias(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) in ("qwen", "qwen3"):  # LlamaConfig.norm_config: RmsNormConfig(use_bias=use_bias), llama.py:177-182
        if value:
            raise Refused(f"{shape_kind(ctx)}'s use_bias also gives its RMSNorms a bias (llama.py:177-182), which "
                          f"Deepy's rmsnorm has not")
        return {"use_bias_in_mlp": False} if shape_kind(ctx) == "qwen" else {"use_bias_in_attn_linear": False,
                                                                             "use_bias_in_mlp": False}
    if shape_kind(ctx) == "olmo2":  # Olmo2Config.use_bias: the MLP's and the RMSNorms' (olmo.py:245-251, 396-399)
        if value:
            raise Refused("OLMo 2's use_bias also gives its RMSNorms a bias (olmo.py:245-251), which Deepy's rmsnorm "
                          "has not; its attention's bias is attention_bias")
        return {"use_bias_in_mlp": False}
    return {"use_bias_in_attn_linear": bool(value), "use_bias_in_mlp": bool(value)}


def _attention_bias(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) != "olmo2":
        raise Refused("an Olmo2Config field (q/k/v/o biases, olmo.py:298-310); give model.type: olmo2")
    return {"use_bias_in_attn_linear": bool(value)}


def _layer_norm_weight(value: Any, ctx: Context) -> dict[str, Any]:
    if value:
        return {}
    if shape_kind(ctx) == "olmo2":  # its q/k norms are RMSNorms with a gain, one per feature of the projection
        raise Refused("OLMo 2 without norm weights (RMSNorm without a gain) is not built here")
    if shape_kind(ctx) == "qwen3":  # its q/k norms are norm_config's RMSNorms (qwen.py:374-376)
        raise Refused("Qwen 3 without norm weights (q/k RMSNorms without a gain) is not built here")
    if shape_kind(ctx) in ("gpt2", "gemma", "gemma2", "gemma3"):  # Gpt2Config and Gemma*Config have no such field
        raise Refused(f"use_layer_norm_weight is a LlamaConfig field; Levanter's {shape_kind(ctx)} has none")
    # the Llama family's norms are RmsNorms (LlamaConfig.norm_config: RmsNormConfig(use_weight=use_layer_norm_weight),
    # llama.py:177-182@9263f81e; Mistral, Mixtral and Qwen inherit it), here without a gain: no mean is subtracted
    return {"norm": "non_parametric_rmsnorm"}


def _tie(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) == "gpt2":
        raise Refused("Levanter's GPT-2 always ties its embeddings; tie_word_embeddings is a llama/mistral field")
    return {"no_weight_tying": not value}


def _gradient_checkpointing(value: Any, ctx: Context) -> dict[str, Any]:
    """True, False or a remat policy name (``nested``, ``offload``, ...): every policy recomputes the
    blocks' activations in the backward, the same maths with less memory."""
    if value is False:
        return {"checkpoint_activations": False}
    out: dict[str, Any] = {"checkpoint_activations": True}
    if value is not True:
        out.update(noted(f"the {value!r} remat policy is Levanter's way of scanning; Deepy recomputes each block"))
    return out


def rope_keys(spec: dict[str, Any]) -> dict[str, Any]:
    """Levanter's ``rope:`` choice (``RotaryEmbeddingsConfig``) as ``rotary_emb_base`` and ``rope_scaling``."""
    kind = str(spec.get("type", "default"))
    defaults = {"default": {"theta": 10000, "factor": 1.0}, "linear": {"theta": 10000, "factor": 1.0},
                "llama3": {"theta": 500000, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192},
                "yarn": {"theta": 10000, "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 2048, "mscale": 1.0}}
    if kind not in defaults:
        raise Refused(f"rope type {kind!r} is not one of Levanter's: {', '.join(defaults)}")
    extra = set(spec) - {"type", *defaults[kind]}
    if extra:
        raise Refused(f"{sorted(extra)} are not fields of Levanter's {kind} rope")
    values = {**defaults[kind], **{k: v for k, v in spec.items() if k != "type"}}
    out: dict[str, Any] = {"rotary_emb_base": values["theta"]}
    factor = float(values["factor"])
    if kind in ("default", "linear"):  # Levanter divides every frequency by factor: linear interpolation
        if factor != 1.0:
            out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "llama3":  # Levanter's port of transformers' llama3 frequencies
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor,
                               "low_freq_factor": float(values["low_freq_factor"]),
                               "high_freq_factor": float(values["high_freq_factor"]),
                               "original_max_position_embeddings": int(values["original_max_position_embeddings"])}
    elif factor != 1.0:  # Levanter's yarn at factor 1 changes no frequency and multiplies cos/sin by 1
        raise Refused("Levanter's yarn with factor != 1 also divides the positions by factor and scales cos/sin by "
                      "sqrt(0.1 mscale ln(factor) + 1), which is not Hugging Face's yarn; Deepy builds HF's "
                      "(rope_scaling), so only factor 1.0 (the plain rotary embedding) is taken")
    return out


def _rope(value: Any, ctx: Context) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Refused("rope is a mapping: {type: default|linear|llama3|yarn, theta: ..., factor: ...}")
    if shape_kind(ctx) == "gpt2":
        raise Refused("Levanter's GPT-2 has learned positions, no rope")
    return rope_keys(value)


def _rope_field(value: Any, ctx: Context) -> dict[str, Any]:
    spec = {path.split(".")[-1]: leaf.value for path, leaf in ctx.leaves.items() if path.startswith("model.rope.")}
    return _rope(spec, ctx)


def _dropout_equal_to_resid(value: Any, ctx: Context) -> dict[str, Any]:
    if value != ctx.value("model.resid_pdrop", 0.0):
        raise Refused("Deepy drops out the embeddings with hidden_dropout, so embed_pdrop must equal resid_pdrop")
    return {}


def _upcast(value: Any, ctx: Context) -> dict[str, Any]:
    # Levanter's default attention backends (jax_flash, nvte, splash) are flash kernels that keep the
    # softmax statistics in fp32 whatever upcast_attn says; only its vanilla backend computes the
    # softmax in the compute dtype without it
    if not value and ctx.value("model.attn_backend") == "vanilla" and "bf" in str(ctx.value("trainer.mp", "f32")):
        raise Refused("with attn_backend vanilla and a bf16 compute dtype Levanter's softmax runs in bf16; "
                      "Deepy's attention keeps it in fp32: set upcast_attn true (or use the default backend)")
    return noted("the attention softmax is accumulated in fp32 (SDPA), as Levanter's flash backends do")


def _attn_backend(value: Any, ctx: Context) -> dict[str, Any]:
    if value not in (None, "default", "jax_flash", "nvte", "splash", "vanilla"):
        raise Refused(f"attn_backend {value!r} is not one of Levanter's (default, jax_flash, nvte, splash, vanilla)")
    return noted("every backend computes exact attention; Deepy's is torch's scaled_dot_product_attention")


def _no_effect(reason: str) -> Rule:
    return lambda value, ctx: noted(reason)


def _equal_or_refuse(default: Any, reason: str) -> Rule:
    """Accepted at Levanter's default (what Deepy builds); another value is refused with ``reason``."""
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if value != default:
            raise Refused(reason)
        return noted(f"{value!r} is Levanter's default, what Deepy builds")
    return rule


def _num_kv_heads(value: Any, ctx: Context) -> dict[str, Any]:
    heads = int(ctx.value("model.num_heads", MODEL_PRESETS[shape_kind(ctx)]["num_attention_heads"]))
    if heads % int(value):
        raise Refused(f"num_heads {heads} is not divisible by num_kv_heads {value} (LlamaConfig asserts it)")
    return {"num_kv_heads": value}


def _mixtral_only(rule: Rule) -> Rule:
    def checked(value: Any, ctx: Context) -> dict[str, Any]:
        if shape_kind(ctx) != "mixtral":
            raise Refused("a MixtralConfig field; give model.type: mixtral")
        return rule(value, ctx)
    return checked


def _balance_coefficient(ctx: Context) -> dict[str, Any]:
    """Levanter's lbl_coef (default 0.01, None: no loss) over top-k: Deepy's balance loss is k times Levanter's."""
    coef = ctx.value("model.lbl_coef", 0.01) if "model.lbl_coef" in ctx.leaves else 0.01
    return {"moe_aux_loss_coeff": 0.0 if coef is None else float(coef) / int(ctx.value("model.num_experts_per_tok", 2))}


def _top_k(value: Any, ctx: Context) -> dict[str, Any]:
    return {"moe_top_k": int(value), **_balance_coefficient(ctx)}


def _shared_experts(value: Any, ctx: Context) -> dict[str, Any]:
    if value:
        raise Refused("shared experts (every token also through n_shared_experts dense MLPs) are not built here")
    return noted("0: no shared experts, as Deepy's MoE layer")


def _mixtral_bias(value: Any, ctx: Context) -> dict[str, Any]:
    if value and shape_kind(ctx) == "mixtral":
        raise Refused("Mixtral's router takes use_bias too (mixtral.py:320); Deepy's router has no bias")
    return _use_bias(value, ctx)


def _gemma_only(rule: Rule, kinds: tuple[str, ...] = ("gemma", "gemma2", "gemma3")) -> Rule:
    """A field of Levanter's Gemma configs (GemmaConfig: gemma; Gemma2Config: gemma2 and gemma3; Gemma3Config)."""
    def checked(value: Any, ctx: Context) -> dict[str, Any]:
        if shape_kind(ctx) not in kinds:
            raise Refused(f"a field of Levanter's {'/'.join(kinds)} config; give model.type: {' or '.join(kinds)}")
        return rule(value, ctx)
    return checked


_GEMMA23 = ("gemma2", "gemma3")


def _attn_softcap(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) != "gemma2":  # Gemma3Config.attention_config passes no logits_soft_cap
        return noted("Levanter's Gemma 3 attention is not capped (gemma.py:907-918@9263f81e)")
    return {"attn_logit_softcapping": None if value is None else float(value)}


def _use_qk_norm(value: Any, ctx: Context) -> dict[str, Any]:
    if shape_kind(ctx) == "gemma3":  # Gemma3Config.attention_config passes qk_norm whatever use_qk_norm says
        return noted("Levanter's Gemma 3 normalises queries and keys always (gemma.py:907-918@9263f81e)")
    return {"use_qk_layernorm": bool(value)}


MODEL_RULES: dict[str, Rule] = {
    "model.type": _model_type_rule,
    "model.hidden_dim": _hidden_dim,
    "model.mlp_scale": _mlp_scale,
    "model.intermediate_dim": _intermediate_dim,
    "model.num_heads": to("num_attention_heads"),
    "model.num_kv_heads": _num_kv_heads,
    "model.num_layers": to("num_layers"),
    "model.seq_len": _seq_len,
    "model.gradient_checkpointing": _gradient_checkpointing,
    "model.scale_attn_by_inverse_layer_idx": to("scale_attn_by_inverse_layer_idx"),
    "model.initializer_range": to("init_method_std"),
    "model.resid_pdrop": to("hidden_dropout"),
    "model.attn_pdrop": to("attention_dropout"),
    "model.embed_pdrop": _dropout_equal_to_resid,
    "model.layer_norm_epsilon": _layer_norm_epsilon,
    "model.activation_function": _activation,
    "model.use_bias": _mixtral_bias,
    "model.use_layer_norm_weight": _layer_norm_weight,
    "model.attention_bias": _attention_bias,
    "model.tie_word_embeddings": _tie,
    "model.rope": _rope,
    **{f"model.rope.{field}": _rope_field for field in ("type", "theta", "factor", "low_freq_factor",
                                                          "high_freq_factor", "original_max_position_embeddings",
                                                          "beta_fast", "beta_slow", "mscale")},
    "model.sliding_window": _no_effect("MistralConfig only writes it into exported HF configs; Levanter's "
                                       "attention (and Deepy's for this config) is full causal"),
    "model.upcast_attn": _upcast,
    "model.attn_backend": _attn_backend,
    "model.use_flash_attention": _no_effect("flash or not, attention is exact; Deepy uses torch's SDPA"),
    "model.flash_attention_block_size": _no_effect("a flash-attention kernel's block size: speed, not maths"),
    "model.cross_entropy_block_size": _no_effect("the block size of Levanter's blockwise cross-entropy: "
                                                 "memory, not maths"),
    "model.scan_layers": _no_effect("JAX's scan over the layers: compile time, not maths"),
    "model.reference_checkpoint": _no_effect("the HF repo Levanter copies config and tokenizer files from "
                                             "when it exports; Deepy's export writes its own"),
    "model.tokenizer": _no_effect("the tokenizer Levanter saves beside an HF export; training reads "
                                  "data.tokenizer"),
    # Levanter's LlamaConfig.actual_head_size (llama.py:237-240 at 9263f81e): head_dim, else hidden_dim // num_heads
    "model.head_dim": lambda v, ctx: {} if v is None or int(v) * int(ctx.value("model.num_heads", 32)) ==
    int(ctx.value("model.hidden_dim", 4096)) else {"kv_channels": int(v)},
    "model.n_routed_experts": _mixtral_only(to("moe_num_experts")),
    "model.num_experts_per_tok": _mixtral_only(_top_k),
    "model.n_shared_experts": _mixtral_only(_shared_experts),
    "model.lbl_coef": _mixtral_only(lambda v, ctx: _balance_coefficient(ctx)),
    "model.rzl_coef": _mixtral_only(lambda v, ctx: {"moe_z_loss_coeff": 0.0 if v is None else float(v)}),
    # Qwen's window raises NotImplementedError once seq_len exceeds it (qwen.py:172-176); Qwen3's is a TODO, not
    # applied (qwen.py:304-306): its attention is full causal
    "model.use_sliding_window": lambda v, ctx: (
        noted("Levanter's Qwen3 does not apply its window (qwen.py:304, a TODO): full causal attention")
        if shape_kind(ctx) == "qwen3" else _equal_or_refuse(False, "use_sliding_window (Levanter's Qwen raises "
                                                             "NotImplementedError for it, qwen.py:172-176)")(v, ctx)),
    "model.max_window_layers": _no_effect("Qwen's first windowed layer; no window is applied (use_sliding_window)"),
    "model.hybrid_norm": _equal_or_refuse(False, "hybrid_norm (extra norms after attention and MLP) is not built here"),
    "model.input_embedding_norm": _equal_or_refuse(False, "input_embedding_norm is not built here"),
    # GemmaConfig.query_pre_attn_scalar (gemma.py:103): no Gemma attention_config passes it (:231-244, 582-592, 907-918)
    "model.query_pre_attn_scalar": _gemma_only(lambda v, ctx: noted(
        "Levanter's Gemma attention scales by 1/sqrt(head_dim) whatever it says (gemma.py:231-244, 582-592, "
        "907-918@9263f81e)")),
    "model.attn_logit_softcapping": _gemma_only(_attn_softcap, _GEMMA23),
    "model.final_logit_softcapping": _gemma_only(lambda v, ctx: noted(
        "Levanter's Gemma 2/3 LM heads never apply it (gemma.py:706-760, 928-990@9263f81e); only exports carry it"),
        _GEMMA23),
    "model.use_qk_norm": _gemma_only(_use_qk_norm, _GEMMA23),
    "model.sliding_window_pattern": _gemma_only(lambda v, ctx: noted(
        "Levanter's Gemma 3 applies no window (gemma.py:789: alternating local/global attention is ignored)"),
        ("gemma3",)),
    "model.rope_local_base_freq": _gemma_only(lambda v, ctx: noted(
        "Levanter's Gemma 3 runs one rope on every layer (Gemma2Transformer, gemma.py:660-700); only exports carry it"),
        ("gemma3",)),
}


def _refuse(reason: str) -> dict[str, Any]:
    raise Refused(reason)


_ABSENT = object()


def _hf_checked(path: str, rule: Rule) -> Rule:
    """``rule`` where the model: section gives the model; where Levanter takes it from the HF checkpoint's
    config.json (:func:`levanter_sft.hf_model_source`) the key is not read: accepted, with a note saying so, when
    what it means agrees with the model built from config.json (and Levanter's defaults), refused by name when not."""
    def checked(value: Any, ctx: Context) -> dict[str, Any]:
        found = levanter_sft.hf_model_source(ctx)
        if found is None:
            return rule(value, ctx)
        shape = levanter_sft.hf_model(ctx)
        assert shape is not None
        where = f"{shape.config_json} ({found[1]}@9263f81e)"
        if path == "model.type" and str(value).lower() != shape.kind:
            raise Refused(f"Levanter builds the model of {where}, a {shape.kind}; remove model.type or make it agree")
        built = {**MODEL_PRESETS[shape.kind], **shape.keys}
        if built.get("num_kv_heads") is None:
            built["num_kv_heads"] = built["num_attention_heads"]
        means = dict(rule(value, ctx))
        means.pop(NOTE, None)
        differ = [f"{key} {means[key]!r} where the model built has {built.get(key, 'none')!r}"
                  for key in means if built.get(key, _ABSENT) != means[key]]
        if differ:
            raise Refused(f"Levanter takes the model from {where}, not from model: ({', '.join(differ)}); "
                          f"remove the key or make it agree")
        return noted(f"not read: Levanter takes the model from {where}; this value agrees with it")
    return checked


MODEL_RULES = {path: _hf_checked(path, rule) for path, rule in MODEL_RULES.items()}
