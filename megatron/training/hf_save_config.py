"""The keys of the Hugging Face checkpoints written while training (``hf_saves.py``), apart from it so the launcher
reads them without torch.

Levanter (stanford-crfm/levanter 9263f81e) writes a ``transformers`` model directory from a trainer hook: train_lm.py's
and sft.py's ``hf_save_path`` / ``hf_save_steps`` (``main/train_lm.py:55-58,204-222``, ``main/sft.py:66-69,290-300``;
train_lm's ``hf_save_dtype``) and lora_lm.py's ``merged_hf_save_path`` (the adapters merged into the base,
``main/lora_lm.py:45,163-168``). These keys do the same here; the dialect maps Levanter's keys onto them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup

HFSaveDtype = Literal["fp32", "bf16", "fp16"]


class HFSaveArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): Hugging Face model directories written while training
    (Levanter's ``hf_save_path``, ``hf_save_steps``, ``hf_save_dtype``; lora_lm.py's ``merged_hf_save_path``)."""

    hf_save_path: str | None = None
    """Directory the model is written to while training as a ``transformers`` model directory (config.json,
    model.safetensors, the tokenizer's files), one per save: ``<path>/step-<N>``, N = the completed steps minus one
    (Levanter's 0-based step). With LoRA adapters the model written has them merged into its weights (lora_lm.py's
    merged_hf_save_path). Written by rank 0 (tp 1, pp 0 or 1; under ZeRO-3 every rank gathers the weights first),
    from the weight average when ema_beta is set; each save says on the console which Deepy checkpoint step it holds
    (step-N: global_step{N+1}). None: none written (export a checkpoint with tools/ckpts/convert_neox_to_hf.py)."""

    hf_save_interval: int = Field(10000, ge=1)
    """HF saves happen after the steps whose 0-based number is a multiple of this (not step 0), and after the last
    step. Levanter's ``hf_save_steps`` (train_lm.py's default 10000)."""

    hf_save_dtype: HFSaveDtype | None = None
    """The dtype of the written weights; None: the training precision's (the weights the model computes with, as
    tools/ckpts/convert_neox_to_hf.py --precision auto writes them). Levanter's ``hf_save_dtype``."""


@rule
def hf_save_layouts(ctx: RuleContext) -> list[str]:
    """The model is written by rank 0 from its whole, unsplit module (under ZeRO-3 gathered by every rank first; a
    pipeline of one stage, ``pipe_parallel_size: 1``, holds every layer): with tensor parallelism, two or more
    pipeline stages or experts split over data-parallel ranks it holds only a part of it; a reward model's scalar
    head has no ``transformers`` causal-LM class."""
    if ctx.get("hf_save_path") is None:
        return []
    key = ctx.show("hf_save_path")
    export = "export a checkpoint with tools/ckpts/convert_neox_to_hf.py"
    problems = []
    if int(ctx.get("model_parallel_size") or 1) > 1:
        problems.append(f"{key} with {ctx.show('model_parallel_size')}: rank 0 holds a tensor-parallel shard of the "
                        f"weights, and gathering them while training is not built; use model_parallel_size: 1, or "
                        f"{export}")
    if int(ctx.get("pipe_parallel_size") or 0) > 1:  # 1: one stage holds every layer (GPT-NeoX's configs)
        problems.append(f"{key} with {ctx.show('pipe_parallel_size')}: a pipeline stage holds only its layers; use "
                        f"pipe_parallel_size: 0 or 1, or {export}")
    if int(ctx.get("moe_expert_parallel_size") or 1) > 1:
        problems.append(f"{key} with {ctx.show('moe_expert_parallel_size')}: experts split over data-parallel ranks; "
                        f"use moe_expert_parallel_size: 1")
    if ctx.get("train_impl") == "rm":
        problems.append(f"{key} with {ctx.show('train_impl')}: a reward model ends in a scalar value head, which no "
                        f"transformers causal-LM class holds")
    return problems
