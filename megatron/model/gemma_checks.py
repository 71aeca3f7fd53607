"""Before-launch checks of Gemma's attention keys (``query_pre_attn_scalar``, ``attn_logit_softcapping``,
``rope_local_base_freq``). Registered with every other check (``megatron/neox_arguments/check_modules.py``);
docs/gemma.md has the facts and their sources.
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule
from megatron.model.family_config import expand_layer_types
from megatron.model.transformer_options import ATTENTION_TYPES


@rule
def query_scale_has_one_source(ctx: RuleContext) -> list[str]:
    """muP scales the scores by 1/head_dim over mup_attn_temp; Gemma's scalar replaces 1/sqrt(head_dim)."""
    if ctx.get("query_pre_attn_scalar") is None or not ctx.get("use_mup"):
        return []
    return [f"{ctx.show('query_pre_attn_scalar')} with {ctx.show('use_mup')}: both set the attention scores' "
            f"scale (muP's 1 / (head_dim x mup_attn_temp), Gemma's query_pre_attn_scalar**-0.5); unset one"]


@rule
def gemma_attention_runs_in_deepy_attention(ctx: RuleContext) -> list[str]:
    """Transformer Engine's attention module (te_mha) has no score cap and no scale of its own here."""
    keys = [k for k in ("query_pre_attn_scalar", "attn_logit_softcapping") if ctx.get(k) is not None]
    if not keys or not ctx.get("te_mha"):
        return []
    return [f"{', '.join(ctx.show(k) for k in keys)} with {ctx.show('te_mha')}: Deepy's own attention computes "
            f"them; Transformer Engine's attention module is built without them. Set te_mha: false"]


@rule
def local_rope_base_has_local_layers(ctx: RuleContext) -> list[str]:
    """rope_local_base_freq changes the rotary base of local layers only: without rotary or a local layer it
    would change nothing."""
    if ctx.get("rope_local_base_freq") is None:
        return []
    if ctx.get("pos_emb") != "rotary":
        return [f"{ctx.show('rope_local_base_freq')} with {ctx.show('pos_emb')}: it is the rotary base of the "
                f"local layers; use pos_emb: rotary or unset it"]
    layers = ctx.get("num_layers")
    try:
        types = expand_layer_types(ctx.get("attention_config") or [[["global"], layers]], layers) if layers else []
    except ValueError:
        return []  # the attention_config check says why
    if types and not any(t in ATTENTION_TYPES and ATTENTION_TYPES[t].windowed for t in types):
        return [f"{ctx.show('rope_local_base_freq')} but {ctx.show('attention_config')} has no local layer: it is "
                f"the rotary base of the local (sliding-window) layers only; unset it or give attention_config "
                f"local layers"]
    return []
