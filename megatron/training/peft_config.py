"""The keys of the PEFT adapter saves while training (``peft_saves.py``), apart from it so the launcher reads them
without torch.

Levanter's ``lora_lm.py`` (stanford-crfm/levanter 9263f81e, ``src/levanter/main/lora_lm.py:42-43,151-158``,
``src/levanter/lora.py:313-403``) writes the adapters in HF PEFT's format into
``<peft_save_path>/<run id>/step-<step>`` every ``hf_save_steps`` steps and once more at the end of training;
these keys do the same here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup

PeftNames = Literal["gpt_neox", "llama"]
# the targets each naming writes: PEFT names one module per adapter, and a Llama model's q/k/v and gate/up are
# separate modules there while Deepy fuses each group into one projection: one adapter, unless lora_split_fused
# gives each section its own (then GPT-NeoX's one query_key_value module cannot hold them)
PEFT_TARGETS: dict[tuple[str, bool], frozenset[str]] = {
    ("gpt_neox", False): frozenset({"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"}),
    ("gpt_neox", True): frozenset({"dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"}),
    ("llama", False): frozenset({"dense", "dense_4h_to_h", "output_layer"}),
    ("llama", True): frozenset({"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"}),
}


class PeftSaveArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): the LoRA adapters saved while training in HF PEFT's
    format (Levanter's ``lora_lm.py`` ``peft_save_path``, ``hf_save_steps``)."""

    lora_peft_save_path: str | None = None
    """Directory the LoRA adapters are written to while training, in HF PEFT's format (adapter_config.json,
    adapter_model.safetensors), one directory per save: ``<path>/step-<N>``, N = the completed steps minus one
    (Levanter's 0-based step). Written by rank 0 (tp 1, pp 0 or 1; under ZeRO-3 every rank gathers them first), from
    the weight average when ema_beta is set. None: no PEFT saves (the checkpoints keep the adapters; export them with
    tools/ckpts/convert_neox_to_hf.py)."""

    lora_peft_save_interval: int = Field(1000, ge=1)
    """PEFT saves happen after the steps whose 0-based number is a multiple of this (not step 0), and after the
    last step. Levanter's ``hf_save_steps`` (default 1000)."""

    lora_peft_names: PeftNames = "gpt_neox"
    """The transformers model the adapters name: gpt_neox (``gpt_neox.layers.N.attention.query_key_value``, ...)
    or llama (``model.layers.N.self_attn.o_proj``, ``mlp.down_proj``; also Mistral), the class the base model
    loads as."""


@rule
def peft_save_layouts(ctx: RuleContext) -> list[str]:
    """The adapters are written by rank 0 from its whole, unsplit model: with tensor parallelism or two or more
    pipeline stages it holds only a part of them (ZeRO-3's partitions are gathered first: ``peft_saves.py``; one
    pipeline stage holds every layer)."""
    if ctx.get("lora_peft_save_path") is None:
        return []
    key = ctx.show("lora_peft_save_path")
    problems = []
    if int(ctx.get("lora_r") or 0) == 0:
        problems.append(f"{key} without adapters: set lora_r > 0")
    if int(ctx.get("model_parallel_size") or 1) > 1:
        problems.append(f"{key} with {ctx.show('model_parallel_size')}: rank 0 holds a tensor-parallel shard of the "
                        "adapters, and gathering them is not built; use model_parallel_size: 1, or export a checkpoint "
                        "with tools/ckpts/convert_neox_to_hf.py --adapters peft")
    if int(ctx.get("pipe_parallel_size") or 0) > 1:  # 1: one stage holds every layer (GPT-NeoX's configs)
        problems.append(f"{key} with {ctx.show('pipe_parallel_size')}: a pipeline stage holds only its layers' "
                        "adapters; use pipe_parallel_size: 0 or 1, or export a checkpoint with "
                        "tools/ckpts/convert_neox_to_hf.py --adapters peft")
    names, split = ctx.get("lora_peft_names"), bool(ctx.get("lora_split_fused"))
    writable = PEFT_TARGETS[(names, split)]
    other = sorted(set(ctx.get("lora_target_modules") or []) - writable)
    if other and split:
        problems.append(f"{ctx.show('lora_target_modules')} with {ctx.show('lora_split_fused')} and "
                        f"{ctx.show('lora_peft_names')}: {other} is one module in {names}, with one adapter in PEFT; "
                        f"set lora_split_fused: false or target {sorted(writable)}")
    elif other:
        problems.append(f"{ctx.show('lora_target_modules')} with {ctx.show('lora_peft_names')}: {other} fuse modules "
                        f"that {names} keeps apart (q/k/v, gate/up), each with its own adapter in PEFT; set "
                        f"lora_split_fused: true (an adapter per section) or target {sorted(writable)}")
    if names == "gpt_neox" and "query_key_value" in (ctx.get("lora_target_modules") or []):
        kv = ctx.get("num_kv_heads")
        if kv is not None and int(kv) != int(ctx.get("num_attention_heads") or 0):
            problems.append(f"{ctx.show('num_kv_heads')} with query_key_value adapters saved for gpt_neox: GPT-NeoX "
                            "has no grouped-query attention")
    return problems
