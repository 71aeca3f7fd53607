"""Before-launch check of ``neox_qkv_order`` (``checkpointing/config.py``): it says how a GPT-NeoX
checkpoint's grouped-query QKV rows are ordered, so it is set only where one is loaded, and never
against the order a Deepy checkpoint records. Only names, markers and ``deepy_meta.json`` are read (no
torch): the launcher runs it. At load time ``files.gqa_order_for`` refuses a grouped-query
GPT-NeoX checkpoint without it.
"""

from __future__ import annotations

from pathlib import Path

from megatron.checkpointing import discovery
from megatron.config_rules import RuleContext, rule

KEY = "neox_qkv_order"
_ORDER_OF_FORMAT = {2: "per_query_head", 3: "per_rank"}  # files.GQA_ORDER_OF_FORMAT, without torch


def _grouped_query(ctx: RuleContext) -> bool:
    heads, kv = ctx.get("num_attention_heads"), ctx.get("num_kv_heads")
    return kv is not None and heads is not None and kv != heads


@rule
def neox_qkv_order_names_a_gpt_neox_checkpoint(ctx: RuleContext) -> list[str]:
    order = ctx.get(KEY)
    source_key = "initialize_from" if ctx.get("initialize_from") else "load"
    source = ctx.get(source_key)
    if order is None:
        loads = source and (source_key == "initialize_from" or ctx.get("load_checkpoint"))
        if loads and _grouped_query(ctx) and discovery.inspect_load_dir(Path(source)).kind == "gpt_neox":
            return [f"{source_key}: {source} is a GPT-NeoX checkpoint, and for a grouped-query model "
                    f"({ctx.show('num_kv_heads')} < num_attention_heads={ctx.get('num_attention_heads')}) its files do "
                    f"not say in which order its QKV rows are: set {KEY}: per_rank (GPT-NeoX since Nov 2024, "
                    f"#1315; its HF converter since May 2025, #1345) or {KEY}: per_query_head (earlier GPT-NeoX). "
                    "A wrong choice gives a different model."]
        return []
    if not source or (source_key == "load" and not ctx.get("load_checkpoint")):
        return [f"{ctx.show(KEY)} but nothing is loaded: it describes a GPT-NeoX checkpoint named by load or "
                "initialize_from; remove it"]
    found = discovery.inspect_load_dir(Path(source))
    if found.kind == "gpt_neox":
        return []
    if found.kind == "deepy":
        point = discovery.resume_point(Path(source))
        meta = point[1] if point is not None else {}
        stored = meta.get("args") or {}
        fmt = meta.get("format")
        recorded = _ORDER_OF_FORMAT.get(fmt) if isinstance(fmt, int) else None
        heads, kv = stored.get("num_attention_heads"), stored.get("num_kv_heads")
        grouped = kv is not None and heads is not None and kv != heads
        if recorded is None or not grouped or recorded == order:
            return []
        return [f"{ctx.show(KEY)}, but {source_key}: {source} holds Deepy checkpoints (format {meta.get('format')}) "
                f"whose grouped-query QKV rows are {recorded}: remove {KEY} (it is for GPT-NeoX's checkpoints)"]
    if found.kind in ("missing", "empty"):
        return [f"{ctx.show(KEY)} but {source_key}: {source} holds no checkpoint yet: remove {KEY}"]
    return []
