"""An HF ``config.json`` (GPTNeoX, Llama, Mistral, Qwen2) as GPT-NeoX model keys, without torch or transformers.

One mapping serves two readers: the HF import (``hf_config.gpt_config_from_hf`` builds its ``GPTConfig``
from these keys, passing ``PretrainedConfig.to_dict()``) and the argument layer before launch (the Levanter
dialect takes the model of a ``lora_lm.py`` / ``sft.py`` run from the checkpoint's ``config.json``, and the
``initialize_from_hf`` check compares the config with it), which reads the plain JSON file.

A field ``save_pretrained`` may leave out is taken at transformers' class default (``LlamaConfig`` /
``MistralConfig`` / ``GPTNeoXConfig``); the fields that fix the shape are required. Both spellings of the
rotary settings are read: transformers 5's ``rope_parameters`` and 4's ``rope_theta`` / ``rope_scaling``
(and GPTNeoX's ``rotary_emb_base`` / ``rotary_pct``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron.errors import ConversionError
from megatron.interop.hf_gemma import GEMMA_FAMILIES, gemma_model_keys
from megatron.interop.hf_olmo2 import OLMO2_FAMILY, olmo2_model_keys
from megatron.model.mlp_width import intermediate_size_for

GATED_FROM_HF: dict[str, str] = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu", "sigmoid": "glu",
                                 "linear": "bilinear"}
"""HF's ``hidden_act`` of a gated (Llama/Mistral) MLP -> Deepy's gated activation."""
PLAIN_FROM_HF: dict[str, str] = {"gelu": "gelu", "relu": "relu", "silu": "silu", "mish": "mish"}
"""HF's ``hidden_act`` of GPTNeoX's plain MLP -> Deepy's activation."""
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
             "vocab_size")
_FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2", "mixtral", "qwen3_moe", OLMO2_FAMILY, "qwen3", "phi3")


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """``<directory>/config.json`` as a dict (plain JSON: nothing is imported or downloaded)."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return data


def rope_fields(cfg: Mapping[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """rope theta, the rotated fraction of a head, and the scaling dict (None: plain rotary)."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:  # transformers 4's spelling
        theta = cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0))
        rope = {**dict(cfg.get("rope_scaling") or {}), "rope_theta": theta}
        if "partial_rotary_factor" in cfg or "rotary_pct" in cfg:
            rope["partial_rotary_factor"] = cfg.get("partial_rotary_factor", cfg.get("rotary_pct"))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    scaling = None if kind == "default" else {k: v for k, v in rope.items()
                                              if k not in ("rope_theta", "partial_rotary_factor")}
    return float(rope.get("rope_theta", 10000.0)), float(rope.get("partial_rotary_factor", 1.0)), scaling


def neox_model_keys(cfg: Mapping[str, Any], seq_length: int | None = None) -> dict[str, Any]:
    """GPT-NeoX model keys for an HF GPTNeoX / Llama / Mistral / Qwen2 config (refuses what Deepy cannot run).
    ``rope_scaling`` stays HF's dict (``model/rope_scaling.py`` parses it)."""
    kind = cfg.get("model_type")
    if kind in GEMMA_FAMILIES:  # Gemma 2 / Gemma 3 text: hf_gemma.py
        return gemma_model_keys(cfg, seq_length)
    if kind not in _FAMILIES:
        raise ConversionError(f"model_type {kind!r} is not supported (GPTNeoX, Llama, Mistral, Qwen2 and Mamba models "
                              "are)")
    missing = [name for name in _REQUIRED if cfg.get(name) is None]
    if missing:
        raise ConversionError(f"the {kind} config has no {', '.join(missing)}")
    theta, factor, scaling = rope_fields(cfg)
    if theta != int(theta):
        raise ConversionError(f"rope_theta: {theta} (Deepy's rotary_emb_base is an integer)")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    max_pos = int(cfg["max_position_embeddings"])
    common: dict[str, Any] = dict(
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=int(seq_length or max_pos),
        max_position_embeddings=max_pos,
        padded_vocab_size=int(cfg["vocab_size"]),
        pos_emb="rotary",
        rotary_emb_base=int(theta),
        rope_scaling=scaling,
        intermediate_size=int(cfg["intermediate_size"]),  # a plain MLP's width; a gated one's below
        # LlamaConfig / MistralConfig default to untied, GPTNeoXConfig too
        no_weight_tying=not bool(cfg.get("tie_word_embeddings", False)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
    )
    if kind == "gpt_neox":
        act = PLAIN_FROM_HF.get(str(cfg.get("hidden_act", "gelu")))
        if act is None:
            raise ConversionError(f"hidden_act: {cfg.get('hidden_act')!r} (Deepy's plain activations: "
                                  f"{sorted(PLAIN_FROM_HF)})")
        if int(hidden // heads * factor) % 2:
            raise ConversionError(f"partial_rotary_factor: {factor} rotates an odd number of dimensions")
        return dict(
            common,  # num_kv_heads unset: GPTNeoX has one key/value head per query head
            rotary_pct=factor,
            norm="layernorm",
            layernorm_epsilon=float(cfg.get("layer_norm_eps", 1e-5)),
            use_bias_in_norms=True,
            use_bias_in_attn_linear=bool(cfg.get("attention_bias", True)),
            use_bias_in_mlp=True,
            activation=act,
            gpt_j_residual=bool(cfg.get("use_parallel_residual", True)),
            hidden_dropout=float(cfg.get("hidden_dropout") or 0.0),
        )
    act = GATED_FROM_HF.get(str(cfg.get("hidden_act", "silu")))
    if act is None:
        raise ConversionError(f"hidden_act: {cfg.get('hidden_act')!r} (Deepy's gated activations compute one of "
                              f"{sorted(GATED_FROM_HF)})")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if factor != 1.0 and kind != "phi3":
        raise ConversionError(f"partial_rotary_factor: {factor} ({kind} rotates the whole head in Deepy)")
    if int(head_dim * factor) % 2:
        raise ConversionError(f"partial_rotary_factor: {factor} rotates an odd number of dimensions")
    # Phi-3 windows every layer as Mistral does (modeling_phi3.py:246, 384)
    window = cfg.get("sliding_window") if kind in ("mistral", "mixtral", "phi3") else None
    if kind in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        # Qwen2Config.__post_init__ (transformers 5.23.0 configuration_qwen2.py:83-94) windows only the layers from
        # max_window_layers on: Mistral's one window for every layer is what Deepy exports
        raise ConversionError("use_sliding_window: true (Qwen2's windowed layers from max_window_layers on are not "
                              "built; Qwen2 models ship with it off)")
    if cfg.get("layer_types") and len(set(cfg["layer_types"])) > 1:
        raise ConversionError(f"layer_types: {sorted(set(cfg['layer_types']))} (mixed layer types are not built)")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    # HF's intermediate_size is each half's width; GPT-NeoX's key is 3x that (mlp_width.py)
    common["intermediate_size"] = intermediate_size_for(int(cfg["intermediate_size"]), gated=True)
    keys = dict(
        common,
        # unset when every query head has its own key/value head: what the stored arguments keep
        # (yaml_config.architecture_keys), so a converted checkpoint reads back as the model converted
        num_kv_heads=None if kv_heads == heads else kv_heads,
        # HF's head_dim (Llama, Mistral, Qwen3 give one; the others use hidden_size // heads): unset when it is that
        kv_channels=None if head_dim * heads == hidden else head_dim,
        rotary_pct=factor,  # 1 but for Phi-3's partial_rotary_factor (modeling_phi3.py:95-97, 180-186)
        norm="rmsnorm",
        rms_norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        # Qwen2 (transformers 5.23.0 modeling_qwen2.py:181-184, 40-42): biases on q/k/v, none on o_proj or the MLP
        use_bias_in_attn_linear=kind != "qwen2" and bool(cfg.get("attention_bias", False)),
        use_bias_in_qkv=kind == "qwen2",
        use_bias_in_mlp=kind != "qwen2" and bool(cfg.get("mlp_bias", False)),
        activation=act,
        sliding_window_width=None if window is None else int(window) - 1,
    )
    if kind in MOE_FAMILIES:
        keys.update(moe_model_keys(cfg))
    if kind == OLMO2_FAMILY:  # post-norms and whole-projection q/k norms (hf_olmo2.py)
        keys.update(olmo2_model_keys(cfg))
    if kind == "qwen3":  # Llama's block with a per-head query/key RMSNorm (transformers 5.23.0 modeling_qwen3.py:229)
        keys["use_qk_layernorm"] = True
    if kind == "phi3":
        keys.update(_phi3_keys(cfg))
    return keys


def _phi3_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3 (transformers 5.23.0 ``models/phi3/``): Llama's maths with fused projections (the converter splits
    them), no biases, dropout before each residual add (``resid_pdrop``, modeling_phi3.py:285-315) but none after
    the embedding (``embd_pdrop`` is read nowhere in modeling_phi3.py), so a nonzero resid_pdrop, which Deepy's
    hidden_dropout would also apply to the embedding, is refused; su/longrope scaling is refused."""
    _, _, scaling = rope_fields(cfg)
    if scaling is not None:
        raise ConversionError(f"rope_parameters: rope_type {scaling.get('rope_type') or scaling.get('type')!r} "
                              f"(Phi-3's longrope/su scaling with its short and long factors is not built; the 4k "
                              f"models use the default rotary)")
    resid = float(cfg.get("resid_pdrop") or 0.0)
    if resid:
        raise ConversionError(f"resid_pdrop: {resid} (Deepy's hidden_dropout drops the embedding output too, which "
                              f"Phi3Model does not; the published Phi-3 models train with 0)")
    return dict(use_bias_in_attn_linear=False, use_bias_in_mlp=False)


MOE_FAMILIES = ("mixtral", "qwen3_moe")
"""HF model types whose MLPs are mixtures of experts (``hf_moe.py`` converts their weights)."""


def moe_model_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE keys of a Mixtral / Qwen3-MoE config (transformers 5.23.0): every layer sparse, softmax top-k
    routing, the k weights renormalised (Mixtral always, ``modeling_mixtral.py:103-110``; Qwen3-MoE with
    ``norm_topk_prob``, ``modeling_qwen3_moe.py:257-266``), each expert as wide as ``intermediate_size``
    (Mixtral) / ``moe_intermediate_size`` (Qwen3-MoE), GPT-NeoX's expert width rule (``mlp_width.expert_width``).
    Qwen3-MoE's attention is Qwen3's: per-head query/key RMSNorm, ``attention_bias`` on all four projections."""
    kind = cfg.get("model_type")
    if kind == "mixtral":
        return dict(moe_num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 8),
                    moe_top_k=int(cfg.get("num_experts_per_tok", 2)), moe_router_type="topk",
                    moe_router_renormalize=True, moe_expert_interval=1,
                    intermediate_size=int(cfg["intermediate_size"]))
    step, dense = int(cfg.get("decoder_sparse_step", 1)), list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense:
        # Qwen3MoeDecoderLayer (modeling_qwen3_moe.py:308-313): sparse where (i + 1) % step == 0 and i not in
        # mlp_only_layers; Deepy's moe_expert_interval n puts MoE layers at 0, n, 2n, ... (GPT-NeoX's rule)
        raise ConversionError(f"decoder_sparse_step: {step}, mlp_only_layers: {dense} (dense layers between the "
                              f"sparse ones are not placed as Deepy's moe_expert_interval places them; Qwen3-MoE "
                              f"ships with every layer sparse)")
    if cfg.get("use_sliding_window"):
        raise ConversionError("use_sliding_window: true (Qwen3-MoE ships with it off; its window is not built)")
    if cfg.get("moe_intermediate_size") is None:
        raise ConversionError("the qwen3_moe config has no moe_intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return dict(moe_num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 128),
                moe_top_k=int(cfg.get("num_experts_per_tok", 8)), moe_router_type="topk",
                moe_router_renormalize=bool(cfg.get("norm_topk_prob", False)), moe_expert_interval=1,
                intermediate_size=int(cfg["moe_intermediate_size"]), use_qk_layernorm=True,
                use_bias_in_attn_linear=bias, use_bias_in_qkv=False)


MATH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "kv_channels", "intermediate_size",
             "pos_emb",
             "rotary_emb_base", "rope_scaling", "rotary_pct", "norm", "layernorm_epsilon", "rms_norm_epsilon",
             "activation", "no_weight_tying", "use_bias_in_attn_linear", "use_bias_in_qkv", "use_bias_in_mlp",
             "gpt_j_residual", "sliding_window_width", "moe_num_experts", "moe_top_k", "moe_router_type",
             "moe_router_renormalize", "moe_expert_interval", "use_qk_layernorm", "qk_norm_scope",
             # Gemma 2/3 (hf_gemma.py)
             "norm_placement", "scale_embeddings_by_sqrt_hidden", "query_pre_attn_scalar", "attn_logit_softcapping",
             "final_logit_softcapping", "rope_local_base_freq", "attention_config")
"""The keys of :func:`neox_model_keys` that change the model's maths: a config that starts from the HF model
must agree with it on each (``initialize_from_hf``'s check before launch)."""


__all__ = ["GATED_FROM_HF", "MATH_KEYS", "MOE_FAMILIES", "PLAIN_FROM_HF", "moe_model_keys", "neox_model_keys",
           "read_config_json", "rope_fields"]
