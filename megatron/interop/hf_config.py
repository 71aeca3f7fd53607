"""Our architecture (``GPTConfig``) in ``transformers``' terms and back.

Which HF class can run a model is decided here, and only from our config:

* ``norm: layernorm`` + a plain (not gated) activation + rotary  -> ``GPTNeoXForCausalLM``
  (partial rotary via ``partial_rotary_factor``, GPT-J parallel residual, tied or untied head);
* ``norm: rmsnorm`` + a gated activation + full rotary            -> ``LlamaForCausalLM``
  (grouped-query attention, optional attention / MLP biases);
* the same with a sliding window on every layer                   -> ``MistralForCausalLM``;
* the same with biases on the query/key/value projection only     -> ``Qwen2ForCausalLM``
  (``use_bias_in_qkv``; no window, no MLP biases);
* every layer ``mamba``                                           -> ``MambaForCausalLM`` (``hf_mamba.py``);
* ``norm: rmsnorm``, ``norm_placement: post`` and query/key norms over the whole projections -> ``Olmo2ForCausalLM``
  (``hf_olmo2.py``);
* ``norm: rmsnorm`` + a gated activation + MoE layers (``moe_num_experts > 1``) -> ``MixtralForCausalLM``, or
  ``Qwen3MoeForCausalLM`` with ``use_qk_layernorm`` (``hf_moe.py``).

Everything else is refused with the feature named (ALiBi, learned or relative positions,
scalenorm, query/key norms, ...): a conversion that silently changes the maths is the failure this
module exists to prevent. Every field of the HF config is set from ours, never left at an HF
default (``intermediate_size`` taken from a default is how GPT-NeoX conversions went wrong before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from megatron.errors import ConversionError
from megatron.interop.hf_gemma import gemma_architecture, gemma_hf_config, gemma_problems
from megatron.interop.hf_mamba import gpt_config_from_mamba, mamba_hf_config, mamba_problems
from megatron.interop.hf_moe import moe_architecture, moe_hf_config, moe_problems
from megatron.interop.hf_olmo2 import is_olmo2, olmo2_hf_config, olmo2_problems
from megatron.model.activations import get_activation
from megatron.model.config import Activation, GPTConfig
from megatron.interop.hf_keys import neox_model_keys
from megatron.model.rope_scaling import RopeScalingError, parse_rope_scaling
from megatron.model.soft_prompt_settings import SoftPromptSettings

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HFArchitecture = Literal["GPTNeoXForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                         "Qwen3ForCausalLM", "Phi3ForCausalLM",
                         "MambaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM",
                         "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"]

# our activation -> the name in transformers' ACT2FN computing exactly the same function
PLAIN_ACTIVATIONS: dict[str, str] = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu", "mish": "mish"}
"""Non-gated activations GPTNeoXForCausalLM can run (HF "gelu" is the exact erf GELU, like ours)."""
GATED_ACTIVATIONS: dict[Activation, str] = {
    "swiglu": "silu", "geglu": "gelu", "reglu": "relu", "glu": "sigmoid", "bilinear": "linear",
}  # fmt: skip
"""Gated activations as Llama's act(gate_proj(x)) * up_proj(x)."""

_LOCAL = "local"


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the HF config names: GPT-NeoX uses its end-of-document token as bos and eos."""

    bos: int | None
    eos: int | None
    pad: int | None


def rotary_factor(config: GPTConfig) -> float:
    """``partial_rotary_factor`` that makes HF rotate exactly our ``rotary_dim`` dimensions."""
    return config.rotary_dim / config.head_dim


def _sliding_window(config: GPTConfig) -> int | None:
    windows = {config.attention_window(i) for i in range(config.arch.layers)}
    if windows == {None}:
        return None
    return next(w for w in windows if w is not None)


def unsupported_features(config: GPTConfig, hf_class: str | None = None) -> tuple[HFArchitecture | None, list[str]]:
    """The HF class for this architecture, and every feature that class cannot reproduce. ``hf_class``
    ``Phi3ForCausalLM`` asks for Phi-3's fused projections where Llama's (or Mistral's, windowed) maths is
    exactly Phi-3's; any other class is chosen from the config alone."""
    families = config.layer_families
    if families == {"mamba"}:  # every layer Mamba: MambaForCausalLM (megatron/interop/hf_mamba.py)
        return "MambaForCausalLM", mamba_problems(config)
    if families != {"transformer"}:
        kinds = ", ".join(sorted(families - {"transformer"}))
        return None, [f"attention_config: {kinds} layers (transformers has MambaForCausalLM for all-Mamba models "
                      f"only; no RWKV-6, gMLP or mixed stacks)"]
    problems: list[str] = []
    if SoftPromptSettings.of(config.soft_prompt_tuning) is not None:
        problems.append("soft_prompt_tuning: enabled (the trained prompt is prepended after the embedding; a "
                        "transformers causal LM has no place for it: export the base model's checkpoint instead)")
    if config.use_mup:
        problems.append("use_mup: true (muP's attention scale 1/head_dim, embedding and output multipliers have no "
                        "equivalent in transformers' GPTNeoX, Llama and Mistral)")
    if config.value_head:
        problems.append("value_head (train_impl: rm): a reward model's value head has no causal-LM equivalent")
    if config.pos_emb != "rotary":
        problems.append(
            f"pos_emb: {config.pos_emb} (GPTNeoX, Llama and Mistral in transformers use rotary positions only)"
        )
    moe = config.moe_num_experts > 1
    gemma = config.norm == "gemma_rmsnorm"  # Gemma 2/3: hf_gemma.py
    olmo2 = config.norm == "rmsnorm" and is_olmo2(config)  # OLMo 2: hf_olmo2.py
    if config.use_qk_layernorm and not moe and not gemma and not olmo2 and config.norm.removeprefix("te_") != "rmsnorm":
        problems.append("use_qk_layernorm: true (GPTNeoX, Llama and Mistral have no query/key norm)")
    if config.norm_placement != "pre" and not gemma and not olmo2:
        problems.append(f"norm_placement: {config.norm_placement} (GPTNeoX, Llama and Mistral normalise before "
                        f"attention and the MLP only; OLMo 2's post-norm needs norm: rmsnorm and use_qk_layernorm with "
                        f"qk_norm_scope: projection, Gemma's sandwich norm: gemma_rmsnorm)")
    if config.use_qk_layernorm and config.qk_norm_scope == "projection" and not olmo2:
        problems.append("qk_norm_scope: projection (only Olmo2ForCausalLM normalises the whole query/key projections; "
                        "it also needs norm: rmsnorm and norm_placement: post)")
    if config.scale_attn_by_inverse_layer_idx:
        problems.append("scale_attn_by_inverse_layer_idx: true (GPTNeoX, Llama and Mistral have no per-layer "
                        "attention scale)")
    if config.opt_pos_emb_offset and config.pos_emb == "learned":
        problems.append(f"opt_pos_emb_offset: {config.opt_pos_emb_offset}")
    layer_kinds = {_LOCAL if config.attention_window(i) is not None else "global" for i in range(config.arch.layers)}
    if len(layer_kinds) > 1 and not gemma:
        problems.append(
            "attention_config mixes sliding-window (local) and global layers (Mistral applies one window to all)"
        )
    window = _sliding_window(config)
    factor = rotary_factor(config)
    if int(config.head_dim * factor) != config.rotary_dim:
        problems.append(f"rotary_pct: {config.rotary_pct} (rotary_dim {config.rotary_dim} is not expressible)")

    norm = config.norm.removeprefix("te_")
    gated = get_activation(config.activation).gated
    arch: HFArchitecture | None = None
    if norm == "layernorm":
        arch = "GPTNeoXForCausalLM"
        if config.mlp_activation not in PLAIN_ACTIVATIONS:
            problems.append(
                f"activation: {config.mlp_activation} (GPTNeoXForCausalLM's MLP is not gated and runs one of "
                f"{sorted(PLAIN_ACTIVATIONS)}; a gated MLP exports as Llama, which needs norm: rmsnorm)"
            )
        if config.kv_heads != config.num_attention_heads:
            problems.append(f"num_kv_heads: {config.kv_heads} (GPTNeoXForCausalLM has no grouped-query attention)")
        if config.head_dim * config.arch.heads != config.arch.hidden:
            problems.append(f"kv_channels: {config.kv_channels} (GPTNeoXForCausalLM's heads are hidden_size / "
                            f"num_attention_heads wide)")
        if window is not None:
            problems.append(f"sliding_window_width: {window} (GPTNeoXForCausalLM has no sliding-window attention)")
        if moe:
            problems.append(f"moe_num_experts: {config.moe_num_experts} (GPTNeoXForCausalLM has no mixture of experts; "
                            f"MixtralForCausalLM and Qwen3MoeForCausalLM need norm: rmsnorm and a gated activation)")
    elif norm == "rmsnorm":
        qwen2 = config.use_bias_in_qkv and not config.use_bias_in_attn_linear
        # Qwen3: Llama's block with a per-head query/key RMSNorm (transformers 5.23.0 modeling_qwen3.py:229-230)
        qwen3 = config.use_qk_layernorm and config.qk_norm_scope == "head"
        arch = ("MistralForCausalLM" if window is not None else "Qwen2ForCausalLM" if qwen2
                else "Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM")
        # Phi-3 (modeling_phi3.py): Llama's maths, fused qkv_proj / gate_up_proj, no biases, a window on every
        # layer or none, a rotated fraction of each head (partial_rotary_factor)
        phi3 = hf_class == "Phi3ForCausalLM" and arch in ("LlamaForCausalLM", "MistralForCausalLM") and not moe
        if phi3:
            arch = "Phi3ForCausalLM"
            if config.use_bias_in_attn_linear or config.use_bias_in_mlp:
                problems.append("use_bias_in_attn_linear / use_bias_in_mlp: true (Phi3ForCausalLM has no biases)")
            if config.head_dim * config.arch.heads != config.arch.hidden:
                problems.append(f"kv_channels: {config.kv_channels} (Phi3Config has no head_dim: its heads are "
                                f"hidden_size / num_attention_heads wide, modeling_phi3.py:196)")
        if olmo2:
            arch = "Olmo2ForCausalLM"
            problems += olmo2_problems(config)
            if window is not None:
                problems.append(f"sliding_window_width: {window} (Olmo2ForCausalLM has no sliding-window attention)")
        if moe:  # hf_moe.py: its own bias, window and router rules
            arch = moe_architecture(config)
            problems += moe_problems(config)
        if config.use_qk_layernorm and config.qk_norm_scope == "head" and not moe and arch != "Qwen3ForCausalLM":
            problems.append(f"use_qk_layernorm: true ({arch} has no query/key norm; Qwen3ForCausalLM has one per head "
                            f"with no window and no Q/K/V-only biases)")
        if arch == "Qwen3ForCausalLM" and config.use_bias_in_mlp:
            problems.append("use_bias_in_mlp: true (Qwen3ForCausalLM's MLP has no biases; attention_bias covers the "
                            "four attention projections: use_bias_in_attn_linear)")
        if config.activation not in GATED_ACTIVATIONS:
            kind = "a plain activation" if not gated else "this gated activation"
            problems.append(
                f"activation: {config.activation} ({kind} has no equivalent in {arch}'s gated MLP; use one of "
                f"{sorted(GATED_ACTIVATIONS)})"
            )
        if config.gpt_j_residual:
            problems.append(f"gpt_j_residual: true ({arch} layers are sequential)")
        if config.rotary_dim != config.head_dim and not phi3:
            problems.append(f"rotary_pct: {config.rotary_pct} ({arch} rotates every dimension of a head; "
                            f"Phi3ForCausalLM rotates a fraction: export with hf_class Phi3ForCausalLM)")
        if arch == "MistralForCausalLM" and (config.use_bias_in_attn_linear or config.use_bias_in_mlp):
            problems.append(
                "use_bias_in_attn_linear / use_bias_in_mlp: true with sliding_window_width (MistralForCausalLM has "
                "no biases; set both to false)"
            )
        if window is not None and qwen2 and not moe:
            problems.append("use_bias_in_qkv: true with sliding_window_width (MistralForCausalLM has no biases; "
                            "Qwen2's window covers the layers from max_window_layers on, which Deepy does not build)")
        if arch == "Qwen2ForCausalLM" and config.head_dim * config.arch.heads != config.arch.hidden:
            # Qwen2Config has no head_dim (transformers 5.23.0 modeling_qwen2.py:175: hidden_size // heads)
            problems.append(f"kv_channels: {config.kv_channels} with use_bias_in_qkv (Qwen2ForCausalLM's heads are "
                            f"hidden_size / num_attention_heads wide)")
        if arch == "Qwen2ForCausalLM" and config.use_bias_in_mlp:
            problems.append("use_bias_in_mlp: true with use_bias_in_qkv (Qwen2ForCausalLM's MLP has no biases; a "
                            "model with biases everywhere exports as Llama with use_bias_in_attn_linear)")
    elif gemma:
        arch = gemma_architecture(config)
        problems += gemma_problems(config, gated)
        if moe:
            problems.append(f"moe_num_experts: {config.moe_num_experts} ({arch} has no mixture of experts)")
        if len({w for w in (config.attention_window(i) for i in range(config.arch.layers)) if w is not None}) > 1:
            problems.append(f"sliding_window_width: several widths ({arch} has one sliding_window)")
    else:
        problems.append(
            f"norm: {config.norm} (only layernorm -> GPTNeoXForCausalLM and rmsnorm -> LlamaForCausalLM/"
            "MistralForCausalLM have an equivalent)"
        )
    return arch, problems


def choose_architecture(config: GPTConfig, hf_class: str | None = None) -> HFArchitecture:
    """The HF class this model exports as (``hf_class`` Phi3ForCausalLM: Phi-3's, where it can carry it)."""
    arch, problems = unsupported_features(config, hf_class)
    if hf_class == "Phi3ForCausalLM" and arch != hf_class and not problems:
        problems = [f"the model exports as {arch}: Phi3ForCausalLM has no biases, no query/key norm, no mixture "
                    f"of experts and one window (or none) on every layer"]
    if problems or arch is None:
        raise ConversionError(
            "this model has no faithful Hugging Face transformers equivalent:\n  - " + "\n  - ".join(problems)
        )
    return arch


def _rope(config: GPTConfig, partial: bool) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_emb_base)}
    if config.rope_scaling_spec is not None:
        rope.update(config.rope_scaling_spec.to_hf())
    if partial:
        rope["partial_rotary_factor"] = rotary_factor(config)
    return rope


def hf_config_from_gpt(config: GPTConfig, tokens: SpecialTokens, dtype: torch.dtype,
                       hf_class: str | None = None) -> "PretrainedConfig":
    """The ``transformers`` config of the class ``choose_architecture`` picks, every field from ours."""
    arch = choose_architecture(config, hf_class)
    if arch == "MambaForCausalLM":
        return mamba_hf_config(config, tokens.bos, tokens.eos, tokens.pad, dtype)
    common: dict[str, Any] = dict(
        architectures=[arch],
        vocab_size=config.padded_vocab_size,  # padding rows included: they are rows of the trained matrix
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size,  # for gated MLPs: the width of each half
        max_position_embeddings=config.max_positions,
        initializer_range=config.init_method_std,
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=not config.no_weight_tying,
        use_cache=True,
        bos_token_id=tokens.bos,
        eos_token_id=tokens.eos,
        pad_token_id=tokens.pad,
        dtype=dtype,
    )
    if arch == "GPTNeoXForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(
            **common,
            hidden_act=PLAIN_ACTIVATIONS[config.mlp_activation],  # bias_gelu_fusion: gelu's tanh form
            hidden_dropout=config.hidden_dropout,
            classifier_dropout=config.hidden_dropout,
            layer_norm_eps=config.layernorm_epsilon,
            use_parallel_residual=config.gpt_j_residual,
            rope_parameters=_rope(config, partial=True),
            attention_bias=config.use_bias_in_attn_linear,
            is_decoder=False,
        )
    if arch in ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return gemma_hf_config(config, common, _rope(config, partial=False))
    gated: dict[str, Any] = dict(
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act=GATED_ACTIVATIONS[config.activation],
        rms_norm_eps=config.rms_norm_epsilon,
        rope_parameters=_rope(config, partial=False),
    )
    if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return moe_hf_config(config, common, gated, _sliding_window(config))
    if arch == "Olmo2ForCausalLM":
        return olmo2_hf_config(common, gated, config)
    if arch == "Qwen2ForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import Qwen2Config

        # Qwen2Config has no head_dim field (modeling_qwen2.py:175 uses hidden_size // heads, what Deepy builds)
        gated.pop("head_dim")
        return Qwen2Config(**common, **gated, use_sliding_window=False)
    if arch == "Qwen3ForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import Qwen3Config

        # attention_bias: all four projections (modeling_qwen3.py:217-228); no window (use_sliding_window false)
        return Qwen3Config(**common, **gated, attention_bias=config.use_bias_in_attn_linear, use_sliding_window=False)
    if arch == "Phi3ForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import Phi3Config

        # no head_dim field (modeling_phi3.py:196); partial rotary through rope_parameters (modeling_phi3.py:95-97);
        # ours: a token sees itself and `window` earlier tokens, HF's sliding_window counts them all (as Mistral's)
        gated.pop("head_dim")
        gated["rope_parameters"] = _rope(config, partial=True)
        window = _sliding_window(config)
        return Phi3Config(**common, **gated, sliding_window=None if window is None else window + 1,
                          original_max_position_embeddings=config.max_positions, resid_pdrop=config.hidden_dropout)
    if arch == "LlamaForCausalLM":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            **gated,
            pretraining_tp=1,
            attention_bias=config.use_bias_in_attn_linear,
            mlp_bias=config.use_bias_in_mlp,
        )
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import MistralConfig

    window = _sliding_window(config)
    assert window is not None
    # ours: a token sees itself and `window` earlier tokens; HF: `sliding_window` tokens in all
    return MistralConfig(**common, **gated, sliding_window=window + 1)


# --- from transformers -----------------------------------------------------------------------
def gpt_config_from_hf(hf: "PretrainedConfig", seq_length: int | None = None) -> GPTConfig:
    """Our architecture for an HF GPTNeoX / Llama / Mistral / Mamba config (refuses what Deepy cannot run):
    the keys of ``hf_keys.neox_model_keys`` (the mapping the argument layer reads config.json with)."""
    if hf.model_type == "mamba":
        return gpt_config_from_mamba(hf, seq_length)
    keys = neox_model_keys(hf.to_dict(), seq_length)
    if keys["rope_scaling"] is not None:
        try:
            scaling = parse_rope_scaling(keys["rope_scaling"], keys["max_position_embeddings"])
        except RopeScalingError as err:
            raise ConversionError(f"rope_parameters: {err}") from None
        keys["rope_scaling"] = None if scaling is None else scaling.to_hf()
    return GPTConfig(**keys)
