"""The Deepy config written next to an imported checkpoint.

It holds the architecture (every key that fixes a weight's shape or the maths), the tokenizer,
the layout the checkpoint was written at and ``load`` pointing at it, so

    python deepy.py train.py <out>/deepy_model.yml your_data_and_schedule.yml

fine-tunes the converted model. The vocabulary padding is chosen so that Deepy pads the tokenizer's
vocabulary to exactly the number of embedding rows the checkpoint holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron.errors import ConversionError
from megatron.interop.hf_tokenizer import TokenizerFiles
from megatron.model.config import GPTConfig
from megatron.model.mlp_width import intermediate_size_for
from megatron.tokenizer.config import padded_vocab_size

CONFIG_NAME = "deepy_model.yml"


def vocab_divisor(rows: int, tokenizer_vocab: int | None, tp: int, preferred: int = 128) -> int:
    """``make_vocab_size_divisible_by`` that pads ``tokenizer_vocab`` to exactly ``rows`` at ``tp``."""
    if rows % tp:
        raise ConversionError(f"the embedding has {rows} rows, which tensor parallelism {tp} cannot split evenly")
    if tokenizer_vocab is not None and tokenizer_vocab > rows:
        raise ConversionError(f"the tokenizer has {tokenizer_vocab} tokens but the embedding only {rows} rows")
    if tokenizer_vocab is not None and padded_vocab_size(tokenizer_vocab, preferred, tp) == rows:
        return preferred
    return rows // tp  # pads any vocabulary of at most `rows` tokens to exactly `rows`


def architecture_keys(config: GPTConfig) -> dict[str, Any]:
    keys: dict[str, Any] = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
    }
    if config.kv_heads != config.num_attention_heads:
        keys["num_kv_heads"] = config.kv_heads
    keys.update(
        seq_length=config.seq_length,
        max_position_embeddings=config.max_positions,
        pos_emb=config.pos_emb,
    )
    if config.pos_emb == "rotary":
        keys.update(rotary_pct=config.rotary_pct, rotary_emb_base=config.rotary_emb_base)
        if config.rope_scaling_spec is not None:
            keys["rope_scaling"] = config.rope_scaling_spec.to_hf()
    if config.opt_pos_emb_offset:
        keys["opt_pos_emb_offset"] = config.opt_pos_emb_offset
    keys["norm"] = config.norm
    if config.norm.removeprefix("te_") in ("rmsnorm", "gemma_rmsnorm"):
        keys["rms_norm_epsilon"] = config.rms_norm_epsilon
    else:
        keys.update(layernorm_epsilon=config.layernorm_epsilon, use_bias_in_norms=config.use_bias_in_norms)
    keys.update(
        activation=config.mlp_activation,  # gelu with bias_gelu_fusion is gelu_tanh
        # GPT-NeoX's key for this width (3x each half when gated, mlp_width.intermediate_size_for)
        intermediate_size=intermediate_size_for(config.ffn_hidden_size, config.mlp_widths.gated),
        use_bias_in_attn_linear=config.use_bias_in_attn_linear,
        use_bias_in_qkv=config.use_bias_in_qkv,
        use_bias_in_mlp=config.use_bias_in_mlp,
        gpt_j_residual=config.gpt_j_residual,
        gpt_j_tied=config.gpt_j_tied,
        no_weight_tying=config.no_weight_tying,
    )
    if config.sliding_window_width is not None:
        keys["sliding_window_width"] = config.sliding_window_width
    if config.moe_num_experts > 1:
        # the key as given: an expert's width is intermediate_size itself (mlp_width.expert_width), the dense MLP's
        # (other blocks, moe_expert_interval > 1) follows GPT-NeoX's rule from the same key
        keys.update(intermediate_size=config.intermediate_size, moe_num_experts=config.moe_num_experts,
                    moe_top_k=config.moe_top_k, moe_router_type=config.moe_router_type,
                    moe_router_renormalize=config.moe_router_renormalize,
                    moe_expert_interval=config.moe_expert_interval)
    if config.use_qk_layernorm:
        keys["use_qk_layernorm"] = True
        if config.qk_norm_scope != "head":  # OLMo 2 (hf_olmo2.py)
            keys["qk_norm_scope"] = config.qk_norm_scope
    if config.norm_placement != "pre":  # OLMo 2 (hf_olmo2.py), Gemma
        keys["norm_placement"] = config.norm_placement
    if config.kv_channels is not None:
        keys["kv_channels"] = config.kv_channels
    # Gemma (hf_gemma.py): written only when set, so other models' files stay as they were
    if config.attention_config is not None:
        keys["attention_config"] = config.attention_config
    for key in ("rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key) is not None:
            keys[key] = getattr(config, key)
    if config.scale_embeddings_by_sqrt_hidden:
        keys["scale_embeddings_by_sqrt_hidden"] = True
    keys.update(
        init_method_std=config.init_method_std,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
    )
    return keys


def write_config(
    out_dir: Path,
    *,
    config: GPTConfig,
    tokenizer: TokenizerFiles | None,
    vocab_divisible_by: int,
    precision: str,
    tp: int,
    pp: int,
    finetune: bool,
    source: str,
    load: Path | None = None,
) -> Path:
    """``deepy_model.yml`` in ``out_dir``, with ``load`` (default ``out_dir``: a conversion writing elsewhere first
    names the directory the checkpoint ends up in)."""
    keys = architecture_keys(config)
    if tokenizer is not None:
        keys["tokenizer_type"] = tokenizer.tokenizer_type
        if tokenizer.vocab_file:
            keys["vocab_file"] = tokenizer.vocab_file
        if tokenizer.merge_file:
            keys["merge_file"] = tokenizer.merge_file
    keys.update(
        make_vocab_size_divisible_by=vocab_divisible_by,
        model_parallel_size=tp,
        pipe_parallel_size=pp,
        precision=precision,
        load=str((out_dir if load is None else load).resolve()),
        finetune=finetune,
    )
    header = [
        f"# Deepy model config for the checkpoint converted from {source}.",
        "# Merge it with your data / schedule configs: python deepy.py train.py THIS.yml YOURS.yml",
        f"# The checkpoint holds weights only, at model_parallel_size {tp} and pipe_parallel_size {pp}: keep",
        f"# those (any data parallelism and ZeRO stage {zero_stages(tp, pp)} work); the optimizer starts fresh.",
    ]
    if finetune:
        header.append("# finetune: true starts at step 0; set it to false to continue at the checkpoint's iteration.")
    else:
        header.append("# finetune: false continues at the checkpoint's iteration; set it to true to start at step 0.")
    if tokenizer is None:
        header.append("# No tokenizer was found next to the model: set tokenizer_type and vocab_file.")
    path = out_dir / CONFIG_NAME
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(keys, sort_keys=False), encoding="utf-8")
    return path


def zero_stages(tp: int, pp: int) -> str:
    """The ZeRO stages the written layout takes (``neox_arguments/rules.py``): DeepSpeed's pipeline engine
    (pipe_parallel_size 1 uses it too) refuses ZeRO-2/3, and ZeRO-3 is refused with tensor parallelism."""
    if pp >= 1:
        return "0-1"
    return "0-2" if tp > 1 else "0-3"
