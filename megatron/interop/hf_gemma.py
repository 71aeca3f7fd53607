"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``) in and out of Deepy, and Gemma (1)
(``GemmaForCausalLM``: the same block with one norm before attention and one before the MLP, no caps, no window,
scores by head_dim**-0.5: transformers 5.23.0 ``models/gemma/modeling_gemma.py:217-226, 284-325``).

Read from transformers 5.23.0 (``models/gemma2/``, ``models/gemma3/``), the code, not its docs; docs/gemma.md
lists each fact with its line. Llama's block (q/k/v/o projections, gate/up/down MLP) with:

* Gemma's RMSNorm ``x / rms(x) * (1 + w)`` everywhere                     -> ``norm: gemma_rmsnorm``;
* a norm before and after attention and the MLP                           -> ``norm_placement: sandwich``
  (HF ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm`` are our ``input_layernorm``, ``attention_output_norm``,
  ``post_attention_layernorm``, ``mlp_output_norm``);
* ``act(gate) * up`` with ``gelu_pytorch_tanh``                            -> ``activation: geglu_tanh``;
* embeddings times sqrt(hidden) in their dtype                            -> ``scale_embeddings_by_sqrt_hidden``;
* ``head_dim``                                                            -> ``kv_channels``;
* ``query_pre_attn_scalar``                                               -> the key of the same name;
* ``layer_types`` (sliding / full) and ``sliding_window``                 -> ``attention_config`` local / global
  layers and ``sliding_window_width`` (= sliding_window - 1: HF lets a query see keys at distance < window);
* Gemma 2: ``attn_logit_softcapping``, ``final_logit_softcapping``        -> the keys of the same names;
* Gemma 3: per-head ``q_norm``/``k_norm`` (Gemma's norm over head_dim)    -> ``use_qk_layernorm``; its own rotary base
  for the sliding layers (``rope_parameters["sliding_attention"]``)       -> ``rope_local_base_freq``; and
  ``final_logit_softcapping`` (its attention ignores ``attn_logit_softcapping``: modeling_gemma3.py:359-368).

No torch import: the argument layer reads config.json through :func:`gemma_model_keys` before launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from megatron.errors import ConversionError
from megatron.model.mlp_width import intermediate_size_for

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from megatron.model.config import GPTConfig

GEMMA_FAMILIES: dict[str, str] = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                  "gemma3_text": "Gemma3ForCausalLM"}
"""HF ``model_type`` -> the class this module converts."""
GEMMA_ARCHITECTURES = tuple(GEMMA_FAMILIES.values())

GEMMA_ACTIVATIONS: dict[str, str] = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu",
                                     "silu": "swiglu", "relu": "reglu"}
"""HF's ``hidden_activation`` of a Gemma MLP, ``act(gate_proj(x)) * up_proj(x)`` -> Deepy's gated activation."""
_TO_HF_ACTIVATION = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu", "swiglu": "silu", "reglu": "relu"}

_LOCAL, _GLOBAL = "local", "global"


def attention_config_of(layer_types: list[str]) -> list[Any]:
    """HF ``layer_types`` as GPT-NeoX's ``attention_config`` (``[[types, repeats], ...]``): the shortest pattern
    that repeats, then the part of it left over (Gemma 3 1B's 26 layers: five local and one global, four times,
    then two local)."""
    types = [_LOCAL if t == "sliding_attention" else _GLOBAL for t in layer_types]
    n = len(types)
    period = next(p for p in range(1, n + 1) if types == (types[:p] * (n // p + 1))[:n])
    config: list[Any] = [[types[:period], n // period]]
    return config + ([[types[: n % period], 1]] if n % period else [])


def _rope_theta(rope: Mapping[str, Any], kind: str, where: str) -> float:
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise ConversionError(f"rope_parameters{where}: rope_type {rope.get('rope_type')!r} (Deepy converts the "
                              f"default rotary of {kind}; the published text models use it)")
    theta = float(rope.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise ConversionError(f"rope_theta{where}: {theta} (Deepy's rotary bases are integers)")
    return theta


def gemma_model_keys(cfg: Mapping[str, Any], seq_length: int | None = None) -> dict[str, Any]:
    """GPT-NeoX model keys for an HF Gemma 2 / Gemma 3 text config (refuses by name what Deepy does not build)."""
    kind = str(cfg.get("model_type"))
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "max_position_embeddings", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"the {kind} config has no {', '.join(missing)}")
    if cfg.get("use_bidirectional_attention"):
        raise ConversionError("use_bidirectional_attention: true (Deepy builds causal language models)")
    hidden, heads, layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # Gemma (1)'s MLP runs hidden_act (modeling_gemma.py:92), whose legacy "gelu" (google/gemma-2b's config.json)
    # GemmaConfig.__post_init__ turns into gelu_pytorch_tanh (configuration_gemma.py:89-96); Gemma 2/3's MLP runs
    # hidden_activation (modeling_gemma2.py:77)
    field = "hidden_act" if kind == "gemma" else "hidden_activation"
    hf_act = str(cfg.get(field) or "gelu_pytorch_tanh")
    if kind == "gemma" and hf_act == "gelu":
        hf_act = "gelu_pytorch_tanh"
    if hf_act not in GEMMA_ACTIVATIONS:
        raise ConversionError(f"{field}: {hf_act!r} (Deepy's gated activations compute one of "
                              f"{sorted(GEMMA_ACTIVATIONS)})")
    every = (["sliding_attention", "full_attention"] * layers)[:layers]  # Gemma2Config.__post_init__'s default
    layer_types = [] if kind == "gemma" else list(cfg.get("layer_types") or every)  # Gemma (1): no window
    local = "sliding_attention" in layer_types
    rope = dict(cfg.get("rope_parameters") or {})
    if kind == "gemma3_text":  # one rope dict per layer type (configuration_gemma3.py:133-160)
        full = _rope_theta(dict(rope.get("full_attention") or {}), kind, "['full_attention']")
        sliding = _rope_theta(dict(rope.get("sliding_attention") or {}), kind, "['sliding_attention']")
    else:
        full = sliding = _rope_theta(rope or {"rope_theta": cfg.get("rope_theta", 10000.0)}, kind, "")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    window = cfg.get("sliding_window")
    scalar = cfg.get("query_pre_attn_scalar")
    max_pos = int(cfg["max_position_embeddings"])
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=None if kv_heads == heads else kv_heads,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        seq_length=int(seq_length or max_pos),
        max_position_embeddings=max_pos,
        padded_vocab_size=int(cfg["vocab_size"]),
        pos_emb="rotary",
        rotary_pct=1.0,
        rotary_emb_base=int(full),
        rope_local_base_freq=int(sliding) if kind == "gemma3_text" and local else None,
        rope_scaling=None,
        # HF's intermediate_size is each half's width; GPT-NeoX's key is 3x that (mlp_width.py)
        intermediate_size=intermediate_size_for(int(cfg["intermediate_size"]), gated=True),
        no_weight_tying=not bool(cfg.get("tie_word_embeddings", True)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        norm="gemma_rmsnorm",
        norm_placement="pre" if kind == "gemma" else "sandwich",
        rms_norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        use_qk_layernorm=kind == "gemma3_text",
        use_bias_in_attn_linear=bool(cfg.get("attention_bias", False)),
        use_bias_in_mlp=False,
        activation=GEMMA_ACTIVATIONS[hf_act],
        scale_embeddings_by_sqrt_hidden=True,
        query_pre_attn_scalar=None if scalar is None or float(scalar) == head_dim else float(scalar),
        attn_logit_softcapping=(None if kind == "gemma3_text" or cfg.get("attn_logit_softcapping") is None
                                else float(cfg["attn_logit_softcapping"])),
        final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                 else float(cfg["final_logit_softcapping"])),
        attention_config=attention_config_of(layer_types) if local else None,
        sliding_window_width=int(window) - 1 if local and window is not None else None,
    )


def gemma_architecture(config: GPTConfig) -> Literal["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"]:
    """Gemma (1) normalises before the sublayers only; Gemma 3 has per-head query/key norms, Gemma 2 none."""
    if config.norm_placement == "pre":
        return "GemmaForCausalLM"
    return "Gemma3ForCausalLM" if config.use_qk_layernorm else "Gemma2ForCausalLM"


def gemma_problems(config: GPTConfig, gated_activation: bool) -> list[str]:
    """What the Gemma class ``gemma_architecture`` picks cannot reproduce of a ``norm: gemma_rmsnorm`` model."""
    arch = gemma_architecture(config)
    problems = []
    if config.activation not in _TO_HF_ACTIVATION:
        kind = "this gated activation" if gated_activation else "a plain activation"
        problems.append(f"activation: {config.activation} ({kind} has no equivalent in {arch}'s gated MLP; use one "
                        f"of {sorted(_TO_HF_ACTIVATION)})")
    if config.norm_placement == "post":
        problems.append(f"norm_placement: {config.norm_placement} (Gemma normalises before attention and the MLP "
                        f"(pre: GemmaForCausalLM) or before and after them (sandwich: Gemma 2 and 3))")
    if not config.scale_embeddings_by_sqrt_hidden:
        problems.append(f"scale_embeddings_by_sqrt_hidden: false ({arch} always scales the embeddings)")
    if config.gpt_j_residual:
        problems.append(f"gpt_j_residual: true ({arch} layers are sequential)")
    if config.rotary_dim != config.head_dim:
        problems.append(f"rotary_pct: {config.rotary_pct} ({arch} rotates every dimension of a head)")
    if config.use_bias_in_mlp:
        problems.append(f"use_bias_in_mlp: true ({arch}'s MLP has no biases)")
    if config.use_bias_in_qkv and not config.use_bias_in_attn_linear:
        problems.append(f"use_bias_in_qkv: true ({arch}'s attention_bias covers all four projections)")
    if config.use_qk_layernorm and config.qk_norm_scope != "head":
        problems.append(f"qk_norm_scope: {config.qk_norm_scope} (Gemma 3 normalises each head)")
    scalar = config.query_pre_attn_scalar
    if scalar is not None and scalar != int(scalar):
        problems.append(f"query_pre_attn_scalar: {scalar} ({arch}'s config holds an integer)")
    if arch == "GemmaForCausalLM":
        extras = ["attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq", "sliding_window_width"]
        problems += [f"{key}: {getattr(config, key)} (GemmaForCausalLM has none; Gemma 2 and 3 have norm_placement: "
                     f"sandwich)" for key in extras if getattr(config, key) is not None]
        if scalar is not None and scalar != config.head_dim:
            problems.append(f"query_pre_attn_scalar: {scalar} (GemmaForCausalLM scales by head_dim**-0.5)")
        if config.use_qk_layernorm:
            problems.append("use_qk_layernorm: true (GemmaForCausalLM has no query/key norms)")
    elif arch == "Gemma3ForCausalLM":
        if config.attn_logit_softcapping is not None:
            problems.append("attn_logit_softcapping with use_qk_layernorm (Gemma3ForCausalLM's attention passes no "
                            "softcap: transformers 5.23.0 modeling_gemma3.py:359-368)")
        if config.rope_scaling is not None and config.rope_local_base_freq is None:
            problems.append("rope_scaling without rope_local_base_freq (Gemma 3 scales its full-attention layers "
                            "only; Deepy would scale every layer)")
    elif config.rope_local_base_freq is not None:
        problems.append("rope_local_base_freq without use_qk_layernorm (Gemma2ForCausalLM has one rotary base; "
                        "Gemma 3's per-layer bases come with its query/key norms)")
    return problems


def _layer_types(config: GPTConfig) -> list[str]:
    return ["sliding_attention" if config.attention_window(i) is not None else "full_attention"
            for i in range(config.arch.layers)]


def gemma_hf_config(config: GPTConfig, common: dict[str, Any], rope: dict[str, Any]) -> PretrainedConfig:
    """The ``Gemma2Config`` / ``Gemma3TextConfig`` of ``config`` (``common``: the fields every class shares)."""
    windows = [w for w in (config.attention_window(i) for i in range(config.arch.layers)) if w is not None]
    scalar = config.query_pre_attn_scalar
    if gemma_architecture(config) == "GemmaForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import GemmaConfig

        return GemmaConfig(**common, num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
                           hidden_act=_TO_HF_ACTIVATION[config.activation], rms_norm_eps=config.rms_norm_epsilon,
                           attention_bias=config.use_bias_in_attn_linear, rope_parameters=rope)
    fields: dict[str, Any] = dict(
        common,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_activation=_TO_HF_ACTIVATION[config.activation],
        rms_norm_eps=config.rms_norm_epsilon,
        attention_bias=config.use_bias_in_attn_linear,
        query_pre_attn_scalar=int(scalar) if scalar is not None else config.head_dim,
        # ours: a token sees itself and `window` earlier tokens; HF: keys at distance < sliding_window
        sliding_window=windows[0] + 1 if windows else config.max_positions,
        layer_types=_layer_types(config),
        final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=config.attn_logit_softcapping,
    )
    if gemma_architecture(config) == "Gemma2ForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import Gemma2Config

        return Gemma2Config(**fields, rope_parameters=rope)
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import Gemma3TextConfig

    local = {"rope_type": "default", "rope_theta": float(config.rope_local_base_freq or config.rotary_emb_base)}
    return Gemma3TextConfig(**fields, rope_parameters={"full_attention": rope, "sliding_attention": local})


# --- weights: Llama's names plus the sandwich norms and Gemma 3's query/key norms -------------------------
_NORMS = (("post_attention_layernorm", "attention_output_norm"),
          ("pre_feedforward_layernorm", "post_attention_layernorm"),
          ("post_feedforward_layernorm", "mlp_output_norm"))
"""HF's norm -> ours (``input_layernorm`` is the same on both sides)."""


def gemma_norms_to_hf(config: GPTConfig, ours: Mapping[str, Any], llama: dict[str, Any]) -> dict[str, Any]:
    """Llama's HF state dict of our weights (``hf_weights._to_llama``) with Gemma's norms put in place (Gemma (1):
    Llama's names)."""
    out = dict(llama)
    if config.norm_placement == "pre":
        return out
    for i in range(config.arch.layers):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        for theirs, mine in _NORMS:
            out[f"{dst}.{theirs}.weight"] = ours[f"{src}.{mine}.weight"]
        if config.use_qk_layernorm:
            for qk in ("q_norm", "k_norm"):
                out[f"{dst}.self_attn.{qk}.weight"] = ours[f"{src}.attention.{qk}.weight"]
    return out


def gemma_norms_from_hf(config: GPTConfig, hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the HF state dict as Llama's names for ``hf_weights._from_llama``, our weights of the norms it does not
    read)."""
    llama: dict[str, Any] = dict(hf)
    extra: dict[str, Any] = {}
    if config.norm_placement == "pre":  # Gemma (1): Llama's names
        return llama, extra
    for i in range(config.arch.layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        missing = [f"{src}.{t}.weight" for t, _ in _NORMS if f"{src}.{t}.weight" not in hf]
        if missing:
            raise ConversionError(f"the checkpoint has no tensor {missing[0]!r} that this architecture needs")
        for theirs, mine in _NORMS:
            extra[f"{dst}.{mine}.weight"] = hf[f"{src}.{theirs}.weight"]
        llama[f"{src}.post_attention_layernorm.weight"] = hf[f"{src}.pre_feedforward_layernorm.weight"]
        if config.use_qk_layernorm:
            for qk in ("q_norm", "k_norm"):
                extra[f"{dst}.attention.{qk}.weight"] = hf[f"{src}.self_attn.{qk}.weight"]
    return llama, extra
