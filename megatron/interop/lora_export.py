"""Exporting a checkpoint that trained LoRA adapters: merged into the weights, or as a PEFT adapter.

* ``merge``: one ``transformers`` model whose projections hold ``W + (alpha/r) B A``.
* ``peft``: the frozen base as a ``transformers`` model in OUTPUT, and the adapters as a PEFT LoRA
  directory in ``OUTPUT/<ADAPTER_DIR>`` (``adapter_config.json`` + ``adapter_model.safetensors``,
  PEFT's names for a GPTNeoX model) whose ``base_model_name_or_path`` is OUTPUT. PEFT's own loader
  is the check: ``PeftModel.from_pretrained(base, adapter)`` must give our logits.

Either way the reference is our model *with its adapters* (``apply_lora`` on a one-process
``GPTModel`` holding the checkpoint's base and adapter weights), on the fixed batch of the plain
export, in fp32: max |Δ logit| <= 1e-4.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from megatron.errors import ConversionError
from megatron.interop.hf_config import choose_architecture, hf_config_from_gpt
from megatron.interop.hf_model import (
    PARITY_TOLERANCE,
    fixed_batch,
    load_hf_model,
    max_logit_difference,
    parity_seq_length,
    save_hf_model,
)
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer, special_tokens_of
from megatron.interop.hf_weights import qkv_ours_to_neox, to_hf_state_dict
from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTModel
from megatron.model.lora import ADAPTER, apply_lora, is_adapter_name, merge_adapters
from megatron.model.lora_config import LoRAArgs
from megatron.model.partitioning import TPPartition, tp_partition_of

AdapterExport = Literal["merge", "peft"]
ADAPTER_DIR = "lora_adapter"
Weights = dict[str, torch.Tensor]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WHOLE = TPPartition(0)
_FROM_ARGS = {"bfloat16": "bf16", "bf16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def lora_config_of(args: dict[str, Any]) -> LoRAArgs:
    """The adapters a checkpoint's stored arguments describe (``lora_r == 0``: none); a key the record
    leaves out takes the schema's default."""
    return LoRAArgs.of_record(args)


def has_adapters(args: dict[str, Any]) -> bool:
    return lora_config_of(args).lora_enabled


@dataclass(frozen=True)
class AdapterExportReport:
    checkpoint: Path
    out_dir: Path
    adapter_dir: Path | None
    architecture: str
    dtype: torch.dtype
    max_logit_diff: float | None


def adapted_model(config: GPTConfig, lora: LoRAArgs, weights: Weights) -> torch.nn.Module:
    """Our model with its adapters, in one process (tp 1), fp32 eval mode, holding ``weights``."""
    fp32 = config.replace(precision="fp32", hidden_dropout=0.0, attention_dropout=0.0,
                          sequence_parallel=False)
    model = GPTModel(fp32)
    apply_lora(model, lora.model_copy(update={"lora_dropout": 0.0}), fp32.seed)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()


def peft_state_dict(config: GPTConfig, weights: Weights) -> Weights:
    """PEFT's names and layout for our adapters on a GPTNeoX model: the fused QKV's rows are interleaved
    per head in transformers, so ``B`` of ``query_key_value`` gets the same row order as its weight; the
    untied head is ``lm_head``."""
    out: Weights = {}
    heads, d = config.arch.heads, config.head_dim
    for key, tensor in weights.items():
        if not is_adapter_name(key):
            continue
        layer, factor = key.rsplit(f".{ADAPTER}.", 1)  # layers.0.attention.query_key_value, lora_B
        if layer.endswith("query_key_value") and factor == "lora_B":
            tensor = qkv_ours_to_neox(tensor, heads, d)
        module = "lm_head" if layer == "output_layer" else f"gpt_neox.{layer}"
        out[f"base_model.model.{module}.{factor}.weight"] = tensor.contiguous()
    return out


def fused_sections(config: GPTConfig) -> Callable[[str], Sequence[int] | None]:
    """The full row sections of a weight (``[q, k, v]``, ``[gate, up]``), which a split adapter follows."""
    return lambda weight: (tp_partition_of(config, weight) or _WHOLE).sections


def write_peft_adapter(config: GPTConfig, lora: LoRAArgs, weights: Weights, adapter_dir: Path, base_dir: Path,
                       dtype: torch.dtype) -> None:
    adapter_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in peft_state_dict(config, weights).items()},
              str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir.resolve()),
        "r": lora.lora_r, "lora_alpha": lora.lora_alpha, "lora_dropout": 0.0,
        "target_modules": ["lm_head" if t == "output_layer" else t for t in lora.lora_target_modules],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


def load_peft_model(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """PEFT's own loader: the exported base in fp32 with the adapter directory applied."""
    # lazy: peft is optional, only to load an export back
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base_dir, torch.float32), str(adapter_dir)).eval()


def _check(delta: float, what: str) -> float:
    if not delta <= PARITY_TOLERANCE:
        raise ConversionError(f"parity check failed: max |logits(Deepy) - logits({what})| = {delta:.3e} > "
                              f"{PARITY_TOLERANCE:.0e} in fp32")
    return delta


def export_adapters(ckpt: Path, config: GPTConfig, args: dict[str, Any], weights: Weights, out_dir: Path, *,
                    mode: AdapterExport, precision: str = "auto", verify: bool = True,
                    tokenizer_files: TokenizerFiles, tokenizer: bool = True,
                    progress: Callable[[str], None] = lambda _: None) -> AdapterExportReport:
    """Write the merged model or base + PEFT adapter for a checkpoint's full ``weights`` (adapters included)."""
    lora = lora_config_of(args)
    arch = choose_architecture(config)
    if mode == "peft" and arch != "GPTNeoXForCausalLM":
        raise ConversionError(f"--adapters peft writes PEFT's GPTNeoX names; this model exports as {arch}: use "
                              "--adapters merge")
    if mode == "peft" and lora.lora_split_fused and "query_key_value" in lora.lora_target_modules:
        raise ConversionError("--adapters peft: lora_split_fused gave q, k and v an adapter each, and GPTNeoX's "
                              "query_key_value is one module with one adapter in PEFT; use --adapters merge")
    dtype = _DTYPES[_FROM_ARGS.get(str(args.get("precision") or "fp32"), "fp32") if precision == "auto" else precision]
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConversionError(f"output directory {out_dir} is not empty; choose a new one")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = (export_tokenizer(tokenizer_files, out_dir, config.max_positions) if tokenizer
              else special_tokens_of(tokenizer_files))
    base = {k: v for k, v in weights.items() if not is_adapter_name(k)}
    hf_config = hf_config_from_gpt(config, tokens, dtype)
    adapter_dir = out_dir / ADAPTER_DIR if mode == "peft" else None
    if mode == "merge":
        progress(f"writing {arch} with the adapters merged (alpha/r = {lora.lora_scale:g}) to {out_dir}")
        merged = merge_adapters(weights, lora.lora_scale, fused_sections(config))
        save_hf_model(hf_config, to_hf_state_dict(config, arch, merged), out_dir, dtype)
    else:
        assert adapter_dir is not None
        progress(f"writing the base {arch} to {out_dir} and the PEFT adapter to {adapter_dir}")
        save_hf_model(hf_config, to_hf_state_dict(config, arch, base), out_dir, dtype)
        write_peft_adapter(config, lora, weights, adapter_dir, out_dir, dtype)
    delta = None
    if verify:
        progress("verifying: our model with its adapters against the export on a fixed batch in fp32")
        rounded = {k: v.to(dtype).float() for k, v in weights.items()}
        ours = adapted_model(config, lora, rounded)
        theirs = load_hf_model(out_dir, torch.float32) if adapter_dir is None else load_peft_model(out_dir, adapter_dir)
        batch = fixed_batch(config.vocab, parity_seq_length(config))
        delta = _check(max_logit_difference(ours, theirs, batch), "peft" if adapter_dir else "transformers")
    return AdapterExportReport(ckpt, out_dir, adapter_dir, arch, dtype, delta)
