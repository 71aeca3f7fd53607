"""Exporting a checkpoint that trained LoRA adapters: merged into the weights, or as a PEFT adapter.

* ``merge``: one ``transformers`` model whose projections hold ``W + (alpha/r) B A``.
* ``peft``: the frozen base as a ``transformers`` model in OUTPUT, and the adapters as a PEFT LoRA
  directory in ``OUTPUT/<ADAPTER_DIR>`` (``adapter_config.json`` + ``adapter_model.safetensors``,
  under the exported model's module paths, whichever architecture it exports as: :func:`peft_adapters`) whose
  ``base_model_name_or_path`` is OUTPUT. PEFT's own loader is the check: ``PeftModel.from_pretrained(base,
  adapter)`` must give our logits.

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
from megatron.interop.hf_weights import to_hf_state_dict
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


def fused_sections(config: GPTConfig) -> Callable[[str], Sequence[int] | None]:
    """The full row sections of a weight (``[q, k, v]``, ``[gate, up]``), which a split adapter follows."""
    return lambda weight: (tp_partition_of(config, weight) or _WHOLE).sections


_WEIGHT_CODE = 2**40
"""Coded weights (:func:`_row_col_maps`): weight number x 2**40 + row x in + col, exact in float64 below 2**53."""


@dataclass(frozen=True)
class PeftAdapter:
    """One PEFT LoRA module of the export: its transformers module path, ``A`` ``[rank, in]`` and ``B``
    ``[out, rank]``; ``rank`` is ``r`` or, where one transformers module holds sections that Deepy adapted each on
    its own (``lora_split_fused``), ``r`` per section it holds (PEFT's ``rank_pattern``)."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    source: str
    """Our adapted layer (``layers.0.attention.query_key_value``)."""


def _row_col_maps(config: GPTConfig, arch: str, weights: Weights,
                  adapted: list[str]) -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    """Where each adapted weight's rows and columns land in the transformers state dict: {hf key: (our weight
    number, our rows, our columns)}, found by converting coded stand-ins of the adapted weights with the export's
    own conversion (``to_hf_state_dict``), so every architecture's layout (GPTNeoX's per-head QKV, a Llama's
    separate q/k/v and gate/up, fused ones) is followed without a second description of it. A transformers tensor
    that is not a row-and-column selection of one of our weights is refused by name."""
    coded = {k: v for k, v in weights.items() if not is_adapter_name(k)}
    for number, name in enumerate(adapted):
        out, fan_in = coded[name].shape
        rows = torch.arange(out, dtype=torch.float64)[:, None] * fan_in
        coded[name] = number * _WEIGHT_CODE + rows + torch.arange(fan_in, dtype=torch.float64)[None, :]
    maps: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    for key, tensor in to_hf_state_dict(config, arch, coded).items():  # type: ignore[arg-type]
        if tensor.dtype != torch.float64:
            continue
        code = tensor.to(torch.int64)
        number = int(code.flatten()[0]) // _WEIGHT_CODE
        if code.dim() != 2 or not number < len(adapted):
            raise ConversionError(f"--adapters peft: {key} holds {adapted[0]} in a shape PEFT's LoRA cannot adapt")
        local, fan_in = code - number * _WEIGHT_CODE, coded[adapted[number]].shape[1]
        rows, cols = local[:, 0] // fan_in, local[0, :] % fan_in
        if not torch.equal(local, rows[:, None] * fan_in + cols[None, :]):
            raise ConversionError(f"--adapters peft: {key} is not a selection of rows and columns of "
                                  f"{adapted[number]}; use --adapters merge")
        maps[key] = (number, rows, cols)
    missing = sorted(set(adapted) - {adapted[n] for n, _, _ in maps.values()})
    if missing:
        raise ConversionError(f"--adapters peft: {missing} have no place in the {arch} export; use --adapters merge")
    return maps


def peft_adapters(config: GPTConfig, arch: str, weights: Weights) -> list[PeftAdapter]:
    """Our adapters as PEFT LoRA modules of the exported transformers model, exactly: a transformers weight
    ``W_hf = W[rows][:, cols]`` gets ``B[rows]`` and ``A[:, cols]`` (``(B A)[rows][:, cols]``), so an adapter on a
    fused projection that transformers keeps apart (q/k/v, gate/up) becomes one PEFT adapter per module, ``A``
    repeated. With ``lora_split_fused`` each section has its own ``A_s`` and ``B``'s rows of that section: a module
    holding sections ``T`` gets ``A = [A_s for s in T]`` and a block ``B`` of rank ``len(T) r``."""
    adapted = sorted(k[: -len(f".{ADAPTER}.lora_A")] + ".weight" for k in weights if k.endswith(f".{ADAPTER}.lora_A"))
    sections = fused_sections(config)
    found: list[PeftAdapter] = []
    for key, (number, rows, cols) in sorted(_row_col_maps(config, arch, weights, adapted).items()):
        layer = adapted[number].removesuffix(".weight")
        a, b = weights[f"{layer}.{ADAPTER}.lora_A"].float(), weights[f"{layer}.{ADAPTER}.lora_B"].float()
        r = b.shape[1]
        if a.shape[0] == r:
            found.append(PeftAdapter(key.removesuffix(".weight"), a[:, cols], b[rows], layer))
            continue
        bounds = torch.tensor(list(sections(adapted[number]) or ())).cumsum(0)
        section = torch.bucketize(rows, bounds, right=True)  # the section of each of our rows
        held = sorted(set(section.tolist()))
        block = torch.zeros(len(rows), len(held) * r)
        for t, s in enumerate(held):
            block[section == s, t * r:(t + 1) * r] = b[rows[section == s]]
        a_held = torch.cat([a[s * r:(s + 1) * r][:, cols] for s in held])
        found.append(PeftAdapter(key.removesuffix(".weight"), a_held, block, layer))
    return found


def _leaf_names(lora: LoRAArgs, adapters: list[PeftAdapter]) -> list[str]:
    """PEFT's ``target_modules``: the transformers modules' last names, in ``lora_target_modules``' order (every
    layer is adapted, so a last name matches exactly the adapted modules)."""
    names: list[str] = []
    for target in lora.lora_target_modules:
        for adapter in adapters:
            leaf = adapter.module.rsplit(".", 1)[-1]
            if adapter.source.rsplit(".", 1)[-1] == target and leaf not in names:
                names.append(leaf)
    return names


def peft_state_dict(config: GPTConfig, weights: Weights, hf_class: str | None = None) -> Weights:
    """``adapter_model.safetensors``' tensors for our adapters, under the module paths of the class the model
    exports as (:func:`peft_adapters`)."""
    tensors: Weights = {}
    for adapter in peft_adapters(config, choose_architecture(config, hf_class), weights):
        tensors[f"base_model.model.{adapter.module}.lora_A.weight"] = adapter.a.contiguous()
        tensors[f"base_model.model.{adapter.module}.lora_B.weight"] = adapter.b.contiguous()
    return tensors


def write_peft_adapter(config: GPTConfig, lora: LoRAArgs, weights: Weights, adapter_dir: Path, base_dir: Path,
                       dtype: torch.dtype, arch: str) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json`` under the transformers model's module paths;
    a module whose rank is not ``r`` (sections adapted apart) gets it in ``rank_pattern`` and ``alpha`` times its
    sections in ``alpha_pattern``, so its scale stays ``alpha / r``."""
    adapters = peft_adapters(config, arch, weights)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for adapter in adapters:
        tensors[f"base_model.model.{adapter.module}.lora_A.weight"] = adapter.a.to(dtype).contiguous()
        tensors[f"base_model.model.{adapter.module}.lora_B.weight"] = adapter.b.to(dtype).contiguous()
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    ranks = {a.module: a.b.shape[1] for a in adapters if a.b.shape[1] != lora.lora_r}
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir.resolve()),
        "r": lora.lora_r, "lora_alpha": lora.lora_alpha, "lora_dropout": 0.0,
        "target_modules": _leaf_names(lora, adapters),
        "rank_pattern": {rf"^{m}$": rank for m, rank in ranks.items()},
        "alpha_pattern": {rf"^{m}$": lora.lora_alpha * rank / lora.lora_r for m, rank in ranks.items()},
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
                    progress: Callable[[str], None] = lambda _: None,
                    hf_class: str | None = None) -> AdapterExportReport:
    """Write the merged model or base + PEFT adapter for a checkpoint's full ``weights`` (adapters included);
    ``hf_class`` as :func:`megatron.interop.convert.export_to_hf`'s (Phi-3's fused projections)."""
    lora = lora_config_of(args)
    arch = choose_architecture(config, hf_class)
    dtype = _DTYPES[_FROM_ARGS.get(str(args.get("precision") or "fp32"), "fp32") if precision == "auto" else precision]
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConversionError(f"output directory {out_dir} is not empty; choose a new one")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = (export_tokenizer(tokenizer_files, out_dir, config.max_positions) if tokenizer
              else special_tokens_of(tokenizer_files))
    base = {k: v for k, v in weights.items() if not is_adapter_name(k)}
    hf_config = hf_config_from_gpt(config, tokens, dtype, hf_class)
    adapter_dir = out_dir / ADAPTER_DIR if mode == "peft" else None
    if mode == "merge":
        progress(f"writing {arch} with the adapters merged (alpha/r = {lora.lora_scale:g}) to {out_dir}")
        merged = merge_adapters(weights, lora.lora_scale, fused_sections(config))
        save_hf_model(hf_config, to_hf_state_dict(config, arch, merged), out_dir, dtype)
    else:
        assert adapter_dir is not None
        progress(f"writing the base {arch} to {out_dir} and the PEFT adapter to {adapter_dir}")
        save_hf_model(hf_config, to_hf_state_dict(config, arch, base), out_dir, dtype)
        write_peft_adapter(config, lora, weights, adapter_dir, out_dir, dtype, arch)
    delta = None
    if verify:
        progress("verifying: our model with its adapters against the export on a fixed batch in fp32")
        rounded = {k: v.to(dtype).float() for k, v in weights.items()}
        ours = adapted_model(config, lora, rounded)
        theirs = load_hf_model(out_dir, torch.float32) if adapter_dir is None else load_peft_model(out_dir, adapter_dir)
        batch = fixed_batch(config.vocab, parity_seq_length(config))
        delta = _check(max_logit_difference(ours, theirs, batch), "peft" if adapter_dir else "transformers")
    return AdapterExportReport(ckpt, out_dir, adapter_dir, arch, dtype, delta)
