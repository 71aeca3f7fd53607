"""OLMo 2 (``Olmo2ForCausalLM``) in and out of Deepy.

Read from transformers 5.23.0 ``models/olmo2/modeling_olmo2.py`` and ``configuration_olmo2.py`` (the code, not its
docs; docs/olmo2.md lists each fact with its line). Llama's block (q/k/v/o projections, gate/up/down MLP without
biases, RMSNorm computed in fp32, rotary over the whole head) with:

* norms after attention and after the MLP, none before (``Olmo2DecoderLayer.forward``, :297-314)
                                                                   -> ``norm_placement: post``; HF's
  ``post_attention_layernorm`` / ``post_feedforward_layernorm`` are our ``attention_output_norm`` / ``mlp_output_norm``;
* ``q_norm`` over ``num_attention_heads * head_dim`` and ``k_norm`` over ``num_key_value_heads * head_dim``, applied
  to the projections before the heads are split and before rotary (:213-228)
                                                                   -> ``use_qk_layernorm`` + ``qk_norm_scope: projection``;
* ``attention_bias`` on all four attention projections (:201-212) -> ``use_bias_in_attn_linear``.

No torch import: the argument layer reads config.json through :func:`olmo2_model_keys` before launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.errors import ConversionError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from megatron.model.config import GPTConfig

    Weights = dict[str, torch.Tensor]  # hf_weights.Weights (which imports hf_config, which imports this module)

OLMO2_FAMILY = "olmo2"
"""HF ``model_type`` of :data:`OLMO2_ARCHITECTURE`."""
OLMO2_ARCHITECTURE = "Olmo2ForCausalLM"

# HF's names of OLMo 2's block norms -> ours
_NORMS = {"post_attention_layernorm": "attention_output_norm", "post_feedforward_layernorm": "mlp_output_norm"}


def olmo2_model_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What an OLMo 2 config changes of the Llama keys ``hf_keys.neox_model_keys`` reads from it."""
    if cfg.get("mlp_bias"):
        raise ConversionError("mlp_bias: true (Olmo2MLP's projections have no bias: modeling_olmo2.py:261-270)")
    return dict(norm_placement="post", use_qk_layernorm=True, qk_norm_scope="projection",
                use_bias_in_attn_linear=bool(cfg.get("attention_bias", False)), use_bias_in_qkv=False,
                use_bias_in_mlp=False)


def is_olmo2(config: GPTConfig) -> bool:
    """The model options only OLMo 2 combines: norms after the sublayers only, q/k norms over the projections."""
    return config.norm_placement == "post" and config.use_qk_layernorm and config.qk_norm_scope == "projection"


def olmo2_problems(config: GPTConfig) -> list[str]:
    """What ``Olmo2ForCausalLM`` cannot reproduce of a ``norm: rmsnorm`` model :func:`is_olmo2` picked."""
    problems = []
    if config.use_bias_in_mlp:
        problems.append("use_bias_in_mlp: true (Olmo2ForCausalLM's MLP has no biases)")
    if config.use_bias_in_qkv and not config.use_bias_in_attn_linear:
        problems.append("use_bias_in_qkv: true (Olmo2ForCausalLM's attention_bias covers all four projections: use "
                        "use_bias_in_attn_linear)")
    if config.head_dim * config.arch.heads != config.arch.hidden:
        # Olmo2Config declares no head_dim (configuration_olmo2.py:70-88): hidden_size // heads (modeling_olmo2.py:195)
        problems.append(f"kv_channels: {config.kv_channels} (Olmo2ForCausalLM's heads are hidden_size / "
                        f"num_attention_heads wide)")
    if config.moe_num_experts > 1:
        problems.append(f"moe_num_experts: {config.moe_num_experts} (Olmo2ForCausalLM has no mixture of experts)")
    return problems


def olmo2_hf_config(common: dict[str, Any], gated: dict[str, Any], config: GPTConfig) -> PretrainedConfig:
    """``Olmo2Config`` with every field from ours (``common`` and ``gated``: ``hf_config``'s Llama fields)."""
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import Olmo2Config

    fields = {k: v for k, v in gated.items() if k != "head_dim"}  # no such field: hidden_size // heads
    return Olmo2Config(**common, **fields, attention_bias=config.use_bias_in_attn_linear)


def olmo2_norms_to_hf(config: GPTConfig, ours: Weights, out: Weights) -> Weights:
    """Add the block norms to the Llama-named ``out`` (``hf_weights._to_llama`` skips a post-norm's)."""
    for i in range(config.arch.layers):
        for theirs, our_name in _NORMS.items():
            out[f"model.layers.{i}.{theirs}.weight"] = _take(ours, f"layers.{i}.{our_name}.weight")
    return out


def olmo2_norms_from_hf(config: GPTConfig, hf: Weights) -> Weights:
    """Our block norms from an OLMo 2 state dict."""
    return {f"layers.{i}.{ours}.weight": _take(hf, f"model.layers.{i}.{theirs}.weight")
            for i in range(config.arch.layers) for theirs, ours in _NORMS.items()}


def _take(weights: Weights, name: str) -> Any:
    if name not in weights:
        raise ConversionError(f"the checkpoint has no tensor {name!r} that Olmo2ForCausalLM needs")
    return weights[name]
