"""Mixture-of-experts models in ``transformers``' terms: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.

Both are Llama's block (``hf_config``/``hf_weights`` convert the attention, norms and embeddings as for Llama)
with every MLP replaced by a sparse block that Deepy's dropless MoE layer (``megatron/model/moe.py``) computes
exactly. Read from transformers 5.23.0, the code:

* router: ``logits = x @ gate.weight.T``, ``softmax`` in fp32, ``topk``, then (Mixtral always,
  ``modeling_mixtral.py:103-110``; Qwen3-MoE when ``norm_topk_prob``, ``modeling_qwen3_moe.py:257-266``) the k
  weights divided by their sum = ``moe_router_type: topk`` with ``moe_router_renormalize``;
* experts: ``gate_up_proj`` [E, 2F, h] whose first F rows are the gate (``chunk(2)``, then
  ``act(gate) * up``) and ``down_proj`` [E, h, F] (``modeling_mixtral.py:56-92``) = our stacked
  ``w1`` [E, h, 2F] (``[gate; up]``) and ``w2`` [E, F, h], transposed; no biases;
* which layers: Mixtral every one (``modeling_mixtral.py:336``); Qwen3-MoE the layer ``i`` with
  ``(i + 1) % decoder_sparse_step == 0`` and ``i`` not in ``mlp_only_layers`` (``modeling_qwen3_moe.py:308-313``):
  every layer at ``decoder_sparse_step: 1`` and ``mlp_only_layers: []`` (what Qwen3-MoE ships), Deepy's
  ``moe_expert_interval: 1``. Other placements are refused by name (Deepy's rule puts the MoE layers at 0, n,
  2n, ..., GPT-NeoX's; HF's at n-1, 2n-1, ...).
* Qwen3-MoE's attention: Qwen3's (``q_norm``/``k_norm`` RMSNorm over each head's ``head_dim``, shared by heads,
  before rotary: ``use_qk_layernorm``; ``attention_bias`` on all four projections).

Training-only router settings are not part of the model: HF's ``router_aux_loss_coef`` (used only with
``output_router_logits``) and ``router_jitter_noise`` (Mixtral multiplies the input of router *and* experts,
``modeling_mixtral.py:123-124``; Deepy's ``moe_jitter_eps`` the router's only) are neither imported nor
exported (exports write 0 noise); set ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` for training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from megatron.errors import ConversionError
from megatron.model.config import GPTConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Weights = dict[str, torch.Tensor]
MoEArchitecture = Literal["MixtralForCausalLM", "Qwen3MoeForCausalLM"]
MOE_ARCHITECTURES: dict[str, MoEArchitecture] = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""HF ``model_type`` -> class, for the MoE families."""


def moe_architecture(config: GPTConfig) -> MoEArchitecture:
    """Qwen3-MoE has query/key norms (every Qwen3 does), Mixtral has none."""
    return "Qwen3MoeForCausalLM" if config.use_qk_layernorm else "MixtralForCausalLM"


def moe_problems(config: GPTConfig) -> list[str]:
    """What the MoE class :func:`moe_architecture` picks cannot reproduce of this (rmsnorm, gated, MoE) model."""
    arch = moe_architecture(config)
    problems = []
    if config.moe_router_type != "topk":
        problems.append(f"moe_router_type: {config.moe_router_type} ({arch}'s router is softmax top-k; "
                        f"set moe_router_type: topk)")
    if arch == "MixtralForCausalLM" and not config.moe_router_renormalize:
        problems.append("moe_router_renormalize: false (MixtralForCausalLM always divides the top-k weights by "
                        "their sum; Qwen3MoeForCausalLM has norm_topk_prob, but also query/key norms)")
    if config.moe_expert_interval != 1:
        problems.append(f"moe_expert_interval: {config.moe_expert_interval} ({arch} here is exported with an MoE "
                        f"layer in every block; Deepy's interval puts them at blocks 0, n, 2n, ...)")
    if config.use_bias_in_mlp:
        problems.append(f"use_bias_in_mlp: true ({arch}'s experts have no biases)")
    if config.use_bias_in_qkv and not config.use_bias_in_attn_linear:
        problems.append(f"use_bias_in_qkv: true ({arch} has no biases on query/key/value alone)")
    if arch == "MixtralForCausalLM" and config.use_bias_in_attn_linear:
        problems.append("use_bias_in_attn_linear: true (MixtralForCausalLM's attention has no biases)")
    if arch == "Qwen3MoeForCausalLM" and config.qk_norm_scope != "head":
        problems.append(f"qk_norm_scope: {config.qk_norm_scope} (Qwen3MoeForCausalLM's q_norm/k_norm act on each head, "
                        f"shared by heads)")
    if arch == "Qwen3MoeForCausalLM" and config.sliding_window_width is not None:
        problems.append("sliding_window_width with use_qk_layernorm (Qwen3MoeForCausalLM exports without a window: "
                        "Qwen3-MoE ships with use_sliding_window false)")
    return problems


def moe_hf_config(config: GPTConfig, common: dict[str, Any], gated: dict[str, Any],
                  window: int | None) -> "PretrainedConfig":
    """The ``MixtralConfig`` / ``Qwen3MoeConfig`` of this model: ``common`` and ``gated`` are the Llama fields
    (``hf_config.hf_config_from_gpt``), ``window`` the sliding window of every layer (None: none)."""
    moe: dict[str, Any] = dict(num_experts_per_tok=config.moe_top_k, output_router_logits=False,
                               router_aux_loss_coef=0.0)
    fields = dict(common, **gated, intermediate_size=config.expert_ffn_hidden_size)
    if moe_architecture(config) == "MixtralForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import MixtralConfig

        # ours: a token sees itself and `window` earlier tokens; HF's sliding_window counts them all
        return MixtralConfig(**fields, **moe, num_local_experts=config.moe_num_experts, router_jitter_noise=0.0,
                             sliding_window=None if window is None else window + 1)
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import Qwen3MoeConfig

    # head_dim is not a Qwen3MoeConfig field but its attention reads it (modeling_qwen3_moe.py:128); every layer
    # is sparse, so the dense MLP width (intermediate_size) is never built: written equal to an expert's
    return Qwen3MoeConfig(**fields, **moe, num_experts=config.moe_num_experts, moe_intermediate_size=config.expert_ffn_hidden_size,
                          norm_topk_prob=config.moe_router_renormalize, decoder_sparse_step=1, mlp_only_layers=[],
                          attention_bias=config.use_bias_in_attn_linear, use_sliding_window=False)


def experts_to_hf(w: Weights, ours: str, hf: str) -> Weights:
    """Layer ``ours``'s MoE MLP (``<ours>.mlp.router/experts``) under HF's names (``<hf>.mlp.gate/experts``)."""
    return {
        f"{hf}.mlp.gate.weight": _take(w, f"{ours}.mlp.router.weight"),
        f"{hf}.mlp.experts.gate_up_proj": _take(w, f"{ours}.mlp.experts.w1").transpose(1, 2).contiguous(),
        f"{hf}.mlp.experts.down_proj": _take(w, f"{ours}.mlp.experts.w2").transpose(1, 2).contiguous(),
    }


def experts_from_hf(hf_state: Weights, src: str, ours: str) -> Weights:
    return {
        f"{ours}.mlp.router.weight": _take(hf_state, f"{src}.mlp.gate.weight"),
        f"{ours}.mlp.experts.w1": _take(hf_state, f"{src}.mlp.experts.gate_up_proj").transpose(1, 2).contiguous(),
        f"{ours}.mlp.experts.w2": _take(hf_state, f"{src}.mlp.experts.down_proj").transpose(1, 2).contiguous(),
    }


def _take(weights: Weights, name: str) -> torch.Tensor:
    if name not in weights:
        raise ConversionError(f"the checkpoint has no tensor {name!r} that this architecture needs")
    return weights[name]


__all__ = ["MOE_ARCHITECTURES", "MoEArchitecture", "experts_from_hf", "experts_to_hf", "moe_architecture",
           "moe_hf_config", "moe_problems"]
