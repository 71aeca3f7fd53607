"""A Mamba model (every layer ``mamba``) in ``transformers``' terms: ``MambaForCausalLM`` and back.

The layer is the same function in both (``megatron/model/mamba.py``; transformers' ``MambaMixer`` /
``MambaBlock``): pre-norm RMSNorm, ``in_proj`` -> ``[x; z]``, depthwise causal conv + silu, ``x_proj`` ->
``[dt; B; C]``, ``dt_proj`` with its bias inside the softplus, the selective scan with ``A = -exp(A_log)``
and ``D``, gated by ``silu(z)``, ``out_proj``. Parameter names inside a layer coincide
(``mixer.in_proj.weight``, ``mixer.A_log``, ...); the rest is renaming (``backbone.embeddings``,
``backbone.norm_f``, ``lm_head``). Refused, with the feature named: position embeddings (transformers'
Mamba has none: ``pos_emb: none``), a norm other than rmsnorm, biases in ``x_proj`` (transformers'
``use_bias`` covers ``in_proj``/``out_proj`` only, GPT-NeoX's ``mamba_use_bias_in_linears`` all three),
an inner width that is not a whole multiple of ``hidden_size`` (``expand`` is an integer there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron.errors import ConversionError
from megatron.model.config import GPTConfig
from megatron.model.family_config import MAMBA_CONV_WIDTH, MAMBA_STATE_SIZE, mamba_shape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Weights = dict[str, torch.Tensor]
_MIXER = ("in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
          "out_proj.weight")


def mamba_problems(config: GPTConfig) -> list[str]:
    """What ``MambaForCausalLM`` cannot reproduce of this (all-Mamba) model."""
    problems = []
    if config.pos_emb != "none":
        problems.append(f"pos_emb: {config.pos_emb} (MambaForCausalLM has no position embeddings; train with "
                        f"pos_emb: none)")
    if config.norm.removeprefix("te_") != "rmsnorm":
        problems.append(f"norm: {config.norm} (MambaForCausalLM's layers and final norm are RMSNorm)")
    if config.mamba_use_bias_in_linears:
        problems.append("mamba_use_bias_in_linears: true (MambaForCausalLM's x_proj has no bias)")
    if config.value_head:
        problems.append("value_head (train_impl: rm): a reward model's value head has no causal-LM equivalent")
    shape = mamba_shape(config)
    if shape.inner % shape.hidden:
        problems.append(f"a Mamba inner width of {shape.inner} (MambaForCausalLM's is expand x hidden_size with an "
                        f"integer expand)")
    return problems


def mamba_hf_config(config: GPTConfig, bos: int | None, eos: int | None, pad: int | None,
                    dtype: torch.dtype) -> "PretrainedConfig":
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import MambaConfig

    shape = mamba_shape(config)
    return MambaConfig(
        architectures=["MambaForCausalLM"],
        vocab_size=config.vocab,
        hidden_size=shape.hidden,
        state_size=MAMBA_STATE_SIZE,
        num_hidden_layers=config.arch.layers,
        layer_norm_epsilon=config.rms_norm_epsilon,
        expand=shape.inner // shape.hidden,
        conv_kernel=MAMBA_CONV_WIDTH,
        use_bias=False,
        use_conv_bias=config.mamba_use_bias_in_conv,
        hidden_act="silu",
        initializer_range=config.init_method_std,
        residual_in_fp32=False,  # Deepy's residual stream is in the model's dtype
        time_step_rank=shape.dt_rank,
        tie_word_embeddings=not config.no_weight_tying,
        use_cache=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype=dtype,
    )


def gpt_config_from_mamba(hf: "PretrainedConfig", seq_length: int | None) -> GPTConfig:
    """Our architecture for an HF ``MambaConfig``."""
    if hf.hidden_act != "silu":
        raise ConversionError(f"hidden_act: {hf.hidden_act!r} (Mamba layers use silu)")
    if int(hf.state_size) != MAMBA_STATE_SIZE or int(hf.conv_kernel) != MAMBA_CONV_WIDTH:
        raise ConversionError(f"state_size {hf.state_size} / conv_kernel {hf.conv_kernel} (GPT-NeoX's Mamba has "
                              f"{MAMBA_STATE_SIZE} / {MAMBA_CONV_WIDTH})")
    if bool(hf.use_bias):
        raise ConversionError("use_bias: true (GPT-NeoX's mamba_use_bias_in_linears also gives x_proj a bias)")
    hidden = int(hf.hidden_size)
    config = GPTConfig(
        num_layers=int(hf.num_hidden_layers), hidden_size=hidden, num_attention_heads=1,
        seq_length=int(seq_length or 2048), padded_vocab_size=int(hf.vocab_size), pos_emb="none", norm="rmsnorm",
        rms_norm_epsilon=float(hf.layer_norm_epsilon), intermediate_size=int(hf.intermediate_size),
        attention_config=[[["mamba"], int(hf.num_hidden_layers)]], mamba_use_bias_in_conv=bool(hf.use_conv_bias),
        no_weight_tying=not bool(hf.tie_word_embeddings), init_method_std=float(hf.initializer_range),
    )
    if mamba_shape(config).dt_rank != int(hf.time_step_rank):
        raise ConversionError(f"time_step_rank: {hf.time_step_rank} (GPT-NeoX's is ceil(hidden_size / 16) = "
                              f"{mamba_shape(config).dt_rank})")
    return config


def _take(weights: Weights, name: str) -> torch.Tensor:
    if name not in weights:
        raise ConversionError(f"the checkpoint has no tensor {name!r} that this architecture needs")
    return weights[name]


def _mixer_fields(config: GPTConfig) -> tuple[str, ...]:
    return _MIXER + (("conv1d.bias",) if config.mamba_use_bias_in_conv else ())


def mamba_to_hf(config: GPTConfig, w: Weights) -> Weights:
    out: Weights = {"backbone.embeddings.weight": _take(w, "embedding.word_embeddings.weight")}
    for i in range(config.arch.layers):
        out[f"backbone.layers.{i}.norm.weight"] = _take(w, f"layers.{i}.norm.weight")
        for field in _mixer_fields(config):
            out[f"backbone.layers.{i}.mixer.{field}"] = _take(w, f"layers.{i}.mixer.{field}")
    out["backbone.norm_f.weight"] = _take(w, "final_norm.weight")
    out["lm_head.weight"] = w["output_layer.weight"] if config.no_weight_tying else out["backbone.embeddings.weight"]
    return out


def mamba_from_hf(config: GPTConfig, hf: Weights) -> Weights:
    out: Weights = {"embedding.word_embeddings.weight": _take(hf, "backbone.embeddings.weight")}
    for i in range(config.arch.layers):
        out[f"layers.{i}.norm.weight"] = _take(hf, f"backbone.layers.{i}.norm.weight")
        for field in _mixer_fields(config):
            out[f"layers.{i}.mixer.{field}"] = _take(hf, f"backbone.layers.{i}.mixer.{field}")
    out["final_norm.weight"] = _take(hf, "backbone.norm_f.weight")
    if config.no_weight_tying:
        out["output_layer.weight"] = _take(hf, "lm_head.weight")
    return out


__all__ = ["gpt_config_from_mamba", "mamba_from_hf", "mamba_hf_config", "mamba_problems", "mamba_to_hf"]
