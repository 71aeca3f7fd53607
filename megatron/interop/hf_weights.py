"""Full weights under our canonical names <-> a ``transformers`` state dict.

Layout differences handled here:

* fused QKV: ours stacks all query heads, then all key heads, then all value heads
  (``[q; k; v]``); GPTNeoX in transformers interleaves per head (``[q_h; k_h; v_h]`` for each
  head h); Llama/Mistral keep three separate projections.
* gated MLP: our first projection is ``[gate; up]``, each ``intermediate_size`` rows; Llama has
  ``gate_proj`` and ``up_proj``.
* rotary: both sides use the half-split convention (dim i pairs with i + rotary_dim/2), so no
  permutation of query/key rows is needed.
* biases GPTNeoX always has (norms, MLP) but our model may not: exported as zeros, which computes
  the same function.
* a tied head: transformers' state dict still lists ``lm_head.weight`` (the embedding itself).
"""

from __future__ import annotations

import torch

from megatron.errors import ConversionError
from megatron.interop.hf_config import HFArchitecture
from megatron.interop.hf_gemma import GEMMA_ARCHITECTURES, gemma_norms_from_hf, gemma_norms_to_hf
from megatron.interop.hf_mamba import mamba_from_hf, mamba_to_hf
from megatron.interop.hf_olmo2 import OLMO2_ARCHITECTURE, olmo2_norms_from_hf, olmo2_norms_to_hf
from megatron.interop.hf_moe import experts_from_hf, experts_to_hf
from megatron.model.config import GPTConfig

Weights = dict[str, torch.Tensor]


def _qkv_sizes(config: GPTConfig) -> list[int]:
    d = config.head_dim
    return [config.arch.heads * d, config.kv_heads * d, config.kv_heads * d]


def qkv_ours_to_neox(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[q; k; v]`` rows -> per-head ``[q_h; k_h; v_h]`` (weights `[3hd, h]` or biases `[3hd]`)."""
    rest = t.shape[1:]
    return t.reshape(3, heads, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)


def qkv_neox_to_ours(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)


def _zeros_like_rows(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape[0], dtype=t.dtype)


def _take(weights: Weights, name: str) -> torch.Tensor:
    if name not in weights:
        raise ConversionError(f"the checkpoint has no tensor {name!r} that this architecture needs")
    return weights[name]


def to_hf_state_dict(config: GPTConfig, arch: HFArchitecture, weights: Weights) -> Weights:
    """HF state dict (``transformers`` names) for our full weights."""
    if arch == "Phi3ForCausalLM":  # Llama's tensors, q/k/v and gate/up fused back
        return _phi3_fused(config, _to_llama(config, weights))
    if arch == "MambaForCausalLM":
        return mamba_to_hf(config, weights)
    if arch == "GPTNeoXForCausalLM":
        return _to_gpt_neox(config, weights)
    if arch in GEMMA_ARCHITECTURES:  # Llama's names plus the sandwich and query/key norms (hf_gemma.py)
        return gemma_norms_to_hf(config, weights, _to_llama(config, weights))
    if arch == OLMO2_ARCHITECTURE:  # Llama's names, the norms after attention and MLP (hf_olmo2.py)
        return olmo2_norms_to_hf(config, weights, _to_llama(config, weights))
    return _to_llama(config, weights)


def from_hf_state_dict(config: GPTConfig, arch: HFArchitecture, hf: Weights) -> Weights:
    """Our full weights (canonical names) from an HF state dict."""
    if arch == "Phi3ForCausalLM":  # Llama's tensors once q/k/v and gate/up are split
        return _from_llama(config, _phi3_split(config, hf))
    if arch == "MambaForCausalLM":
        return mamba_from_hf(config, hf)
    if arch == "GPTNeoXForCausalLM":
        return _from_gpt_neox(config, hf)
    if arch in GEMMA_ARCHITECTURES:  # Llama's names plus the sandwich and query/key norms (hf_gemma.py)
        llama, norms = gemma_norms_from_hf(config, hf)
        return {**_from_llama(config, llama), **norms}
    if arch == OLMO2_ARCHITECTURE:  # Llama's names, the norms after attention and MLP (hf_olmo2.py)
        return {**_from_llama(config, hf), **olmo2_norms_from_hf(config, hf)}
    return _from_llama(config, hf)


# --- GPTNeoXForCausalLM ------------------------------------------------------------------------
def _norm_to_hf(weights: Weights, ours: str, out: Weights, theirs: str) -> None:
    weight = _take(weights, f"{ours}.weight")
    out[f"{theirs}.weight"] = weight
    bias = weights.get(f"{ours}.bias")
    out[f"{theirs}.bias"] = bias if bias is not None else torch.zeros_like(weight)


def _to_gpt_neox(config: GPTConfig, w: Weights) -> Weights:
    out: Weights = {"gpt_neox.embed_in.weight": _take(w, "embedding.word_embeddings.weight")}
    heads, d = config.arch.heads, config.head_dim
    for i in range(config.arch.layers):
        ours, hf = f"layers.{i}", f"gpt_neox.layers.{i}"
        _norm_to_hf(w, f"{ours}.input_layernorm", out, f"{hf}.input_layernorm")
        # gpt_j_tied: one shared norm; HF has two, so the second is a copy
        second = f"{ours}.post_attention_layernorm" if not config.gpt_j_tied else f"{ours}.input_layernorm"
        _norm_to_hf(w, second, out, f"{hf}.post_attention_layernorm")
        qkv = _take(w, f"{ours}.attention.query_key_value.weight")
        out[f"{hf}.attention.query_key_value.weight"] = qkv_ours_to_neox(qkv, heads, d)
        out[f"{hf}.attention.dense.weight"] = _take(w, f"{ours}.attention.dense.weight")
        if config.use_bias_in_attn_linear:
            qkv_bias = _take(w, f"{ours}.attention.query_key_value.bias")
            out[f"{hf}.attention.query_key_value.bias"] = qkv_ours_to_neox(qkv_bias, heads, d)
            out[f"{hf}.attention.dense.bias"] = _take(w, f"{ours}.attention.dense.bias")
        for name in ("dense_h_to_4h", "dense_4h_to_h"):
            weight = _take(w, f"{ours}.mlp.{name}.weight")
            out[f"{hf}.mlp.{name}.weight"] = weight
            bias = w.get(f"{ours}.mlp.{name}.bias")
            out[f"{hf}.mlp.{name}.bias"] = bias if bias is not None else _zeros_like_rows(weight)
    _norm_to_hf(w, "final_norm", out, "gpt_neox.final_layer_norm")
    out["lm_head.weight"] = w["output_layer.weight"] if config.no_weight_tying else out["gpt_neox.embed_in.weight"]
    return out


def _from_gpt_neox(config: GPTConfig, hf: Weights) -> Weights:
    out: Weights = {"embedding.word_embeddings.weight": _take(hf, "gpt_neox.embed_in.weight")}
    heads, d = config.arch.heads, config.head_dim
    for i in range(config.arch.layers):
        ours, src = f"layers.{i}", f"gpt_neox.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            for field in ("weight", "bias"):
                out[f"{ours}.{norm}.{field}"] = _take(hf, f"{src}.{norm}.{field}")
        qkv = _take(hf, f"{src}.attention.query_key_value.weight")
        out[f"{ours}.attention.query_key_value.weight"] = qkv_neox_to_ours(qkv, heads, d)
        out[f"{ours}.attention.dense.weight"] = _take(hf, f"{src}.attention.dense.weight")
        if config.use_bias_in_attn_linear:
            bias = _take(hf, f"{src}.attention.query_key_value.bias")
            out[f"{ours}.attention.query_key_value.bias"] = qkv_neox_to_ours(bias, heads, d)
            out[f"{ours}.attention.dense.bias"] = _take(hf, f"{src}.attention.dense.bias")
        for name in ("dense_h_to_4h", "dense_4h_to_h"):
            for field in ("weight", "bias"):
                out[f"{ours}.mlp.{name}.{field}"] = _take(hf, f"{src}.mlp.{name}.{field}")
    for field in ("weight", "bias"):
        out[f"final_norm.{field}"] = _take(hf, f"gpt_neox.final_layer_norm.{field}")
    if config.no_weight_tying:
        out["output_layer.weight"] = _take(hf, "lm_head.weight")
    return out


# --- LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (its q/k/v biases alone: use_bias_in_qkv) ----------------------------------------------------------
def _to_llama(config: GPTConfig, w: Weights) -> Weights:
    out: Weights = {"model.embed_tokens.weight": _take(w, "embedding.word_embeddings.weight")}
    sizes = _qkv_sizes(config)
    ffn = config.ffn_hidden_size
    for i in range(config.arch.layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        if config.norm_placement != "post":  # OLMo 2 has no norms before its sublayers
            out[f"{hf}.input_layernorm.weight"] = _take(w, f"{ours}.input_layernorm.weight")
            out[f"{hf}.post_attention_layernorm.weight"] = _take(w, f"{ours}.post_attention_layernorm.weight")
        q, k, v = _take(w, f"{ours}.attention.query_key_value.weight").split(sizes, dim=0)
        out.update({f"{hf}.self_attn.q_proj.weight": q, f"{hf}.self_attn.k_proj.weight": k,
                    f"{hf}.self_attn.v_proj.weight": v})  # fmt: skip
        out[f"{hf}.self_attn.o_proj.weight"] = _take(w, f"{ours}.attention.dense.weight")
        if config.qkv_bias:
            qb, kb, vb = _take(w, f"{ours}.attention.query_key_value.bias").split(sizes, dim=0)
            out.update({f"{hf}.self_attn.q_proj.bias": qb, f"{hf}.self_attn.k_proj.bias": kb,
                        f"{hf}.self_attn.v_proj.bias": vb})  # fmt: skip
        if config.use_bias_in_attn_linear:
            out[f"{hf}.self_attn.o_proj.bias"] = _take(w, f"{ours}.attention.dense.bias")
        if config.use_qk_layernorm:  # Qwen3, Qwen3-MoE: per-head query/key norms (before rotary, as ours)
            for qk in ("q_norm", "k_norm"):
                out[f"{hf}.self_attn.{qk}.weight"] = _take(w, f"{ours}.attention.{qk}.weight")
        if config.is_moe_layer(i):  # Mixtral / Qwen3-MoE: router and stacked experts (hf_moe.py)
            out.update(experts_to_hf(w, ours, hf))
            continue
        gate, up = _take(w, f"{ours}.mlp.dense_h_to_4h.weight").split([ffn, ffn], dim=0)
        out[f"{hf}.mlp.gate_proj.weight"], out[f"{hf}.mlp.up_proj.weight"] = gate, up
        out[f"{hf}.mlp.down_proj.weight"] = _take(w, f"{ours}.mlp.dense_4h_to_h.weight")
        if config.use_bias_in_mlp:
            gate_b, up_b = _take(w, f"{ours}.mlp.dense_h_to_4h.bias").split([ffn, ffn], dim=0)
            out[f"{hf}.mlp.gate_proj.bias"], out[f"{hf}.mlp.up_proj.bias"] = gate_b, up_b
            out[f"{hf}.mlp.down_proj.bias"] = _take(w, f"{ours}.mlp.dense_4h_to_h.bias")
    out["model.norm.weight"] = _take(w, "final_norm.weight")
    out["lm_head.weight"] = w["output_layer.weight"] if config.no_weight_tying else out["model.embed_tokens.weight"]
    return out


def _from_llama(config: GPTConfig, hf: Weights) -> Weights:
    out: Weights = {"embedding.word_embeddings.weight": _take(hf, "model.embed_tokens.weight")}
    for i in range(config.arch.layers):
        ours, src = f"layers.{i}", f"model.layers.{i}"
        if config.norm_placement != "post":  # OLMo 2 has no norms before its sublayers
            out[f"{ours}.input_layernorm.weight"] = _take(hf, f"{src}.input_layernorm.weight")
            out[f"{ours}.post_attention_layernorm.weight"] = _take(hf, f"{src}.post_attention_layernorm.weight")
        proj = [_take(hf, f"{src}.self_attn.{p}_proj.weight") for p in "qkv"]
        out[f"{ours}.attention.query_key_value.weight"] = torch.cat(proj, dim=0)
        out[f"{ours}.attention.dense.weight"] = _take(hf, f"{src}.self_attn.o_proj.weight")
        if config.qkv_bias:
            biases = [_take(hf, f"{src}.self_attn.{p}_proj.bias") for p in "qkv"]
            out[f"{ours}.attention.query_key_value.bias"] = torch.cat(biases, dim=0)
        if config.use_bias_in_attn_linear:
            out[f"{ours}.attention.dense.bias"] = _take(hf, f"{src}.self_attn.o_proj.bias")
        if config.use_qk_layernorm:  # Qwen3, Qwen3-MoE: per-head query/key norms (before rotary, as ours)
            for qk in ("q_norm", "k_norm"):
                out[f"{ours}.attention.{qk}.weight"] = _take(hf, f"{src}.self_attn.{qk}.weight")
        if config.is_moe_layer(i):  # Mixtral / Qwen3-MoE: router and stacked experts (hf_moe.py)
            out.update(experts_from_hf(hf, src, ours))
            continue
        gate_up = [_take(hf, f"{src}.mlp.{p}_proj.weight") for p in ("gate", "up")]
        out[f"{ours}.mlp.dense_h_to_4h.weight"] = torch.cat(gate_up, dim=0)
        out[f"{ours}.mlp.dense_4h_to_h.weight"] = _take(hf, f"{src}.mlp.down_proj.weight")
        if config.use_bias_in_mlp:
            gate_up_b = [_take(hf, f"{src}.mlp.{p}_proj.bias") for p in ("gate", "up")]
            out[f"{ours}.mlp.dense_h_to_4h.bias"] = torch.cat(gate_up_b, dim=0)
            out[f"{ours}.mlp.dense_4h_to_h.bias"] = _take(hf, f"{src}.mlp.down_proj.bias")
    out["final_norm.weight"] = _take(hf, "model.norm.weight")
    if config.no_weight_tying:
        out["output_layer.weight"] = _take(hf, "lm_head.weight")
    return out


# --- Phi3ForCausalLM: Llama's tensors with qkv_proj and gate_up_proj fused -------------------------------------
# transformers 5.23.0 modeling_phi3.py:218-222 slices qkv_proj's output into [q | k | v] (all query heads, then
# the key heads, then the value heads: our fused QKV's rows as they are), :59-61 chunks gate_up_proj's into
# [gate | up] (our dense_h_to_4h's rows).
def _phi3_fused(config: GPTConfig, llama: Weights) -> Weights:
    out = dict(llama)
    for i in range(config.arch.layers):
        hf = f"model.layers.{i}"
        out[f"{hf}.self_attn.qkv_proj.weight"] = torch.cat([out.pop(f"{hf}.self_attn.{p}_proj.weight") for p in "qkv"])
        out[f"{hf}.mlp.gate_up_proj.weight"] = torch.cat([out.pop(f"{hf}.mlp.{p}_proj.weight") for p in ("gate", "up")])
    return out


def _phi3_split(config: GPTConfig, hf: Weights) -> Weights:
    out = dict(hf)
    ffn = config.ffn_hidden_size
    for i in range(config.arch.layers):
        src = f"model.layers.{i}"
        q, k, v = _take(out, f"{src}.self_attn.qkv_proj.weight").split(_qkv_sizes(config), dim=0)
        out.update({f"{src}.self_attn.q_proj.weight": q, f"{src}.self_attn.k_proj.weight": k,
                    f"{src}.self_attn.v_proj.weight": v})  # fmt: skip
        gate, up = _take(out, f"{src}.mlp.gate_up_proj.weight").split([ffn, ffn], dim=0)
        out[f"{src}.mlp.gate_proj.weight"], out[f"{src}.mlp.up_proj.weight"] = gate, up
    return out
