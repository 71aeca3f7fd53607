"""Saving the LoRA adapters while training in HF PEFT's format, as Levanter's ``lora_lm.py`` does.

When, where and what (stanford-crfm/levanter 9263f81e):
- ``trainer.add_hook(save_peft_checkpoint_callback(...), every=hf_save_steps)`` (``main/lora_lm.py:151-158``);
  a hook runs when ``info.step % every == 0`` (``trainer.py:97-100``) and once more, forced, after the last step
  (``trainer.py:448-449``), where ``info.step`` is the 0-based step just completed (``int(state.step) - 1``,
  ``callbacks/_core.py:37``); the callback skips ``info.step == 0`` (``lora.py:384-387``).
- into ``<peft_save_path>/<run id>/step-<info.step>`` (``lora_lm.py:152``, ``lora.py:400``): Levanter's dialect
  gives ``lora_peft_save_path`` as ``<peft_save_path>/<run id>``, and the steps go below it;
- ``adapter_model.safetensors`` and ``adapter_config.json`` (``lora.py:313-314,345-349``; the config's values
  ``lora.py:504-516``), written from ``step.eval_model`` (the EMA when there is one, ``trainer_state.py:82-94``).

Here rank 0 holds the whole model (tp 1, pp 0 or 1: ``peft_config.peft_save_layouts``; under ZeRO-3 every rank
gathers the adapters first, ``hf_saves.live_weights``) and writes it; the step directory appears whole (written
beside it, then renamed: a reader never sees half of one); ``step-N`` holds the adapters after N + 1 steps (Deepy's
``global_step{N+1}``, said on the console). The rules that keep every rank in step are ``step_saves.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megatron.checkpointing.commit import tag_for
from megatron.model.config import GPTConfig
from megatron.model.lora import ADAPTER
from megatron.model.lora_config import LoRAArgs
from megatron.training.peft_config import PeftNames, PeftSaveArgs
from megatron.training.step_saves import Agree, StepSaves, alone, levanter_step, write_whole
from megatron.training.step_saves import save_due, step_dir  # noqa: F401  (the hooks' step rule, read by tests)

Weights = dict[str, torch.Tensor]
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Deepy's module path -> the transformers model's modules, per naming (the base's names in
# megatron/interop/hf_weights.py); a fused projection maps onto one module per section when its adapter is split
# by sections (lora_split_fused), in the order of the sections
_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt_neox": {"attention.query_key_value": ("attention.query_key_value",), "attention.dense": ("attention.dense",),
                 "mlp.dense_h_to_4h": ("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h": ("mlp.dense_4h_to_h",)},
    "llama": {"attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "attention.dense": ("self_attn.o_proj",), "mlp.dense_h_to_4h": ("mlp.gate_proj", "mlp.up_proj"),
              "mlp.dense_4h_to_h": ("mlp.down_proj",)},
}
_PREFIX = {"gpt_neox": "base_model.model.gpt_neox.layers", "llama": "base_model.model.model.layers"}
_HEAD = {"gpt_neox": "lm_head", "llama": "lm_head"}
"""The untied output head's module in each transformers model."""
_PEFT_TARGET = {"gpt_neox": {"query_key_value": ["query_key_value"], "dense_h_to_4h": ["dense_h_to_4h"],
                             "dense": ["dense"], "dense_4h_to_h": ["dense_4h_to_h"], "output_layer": ["lm_head"]},
                "llama": {"query_key_value": ["q_proj", "k_proj", "v_proj"], "dense": ["o_proj"],
                          "dense_h_to_4h": ["gate_proj", "up_proj"], "dense_4h_to_h": ["down_proj"],
                          "output_layer": ["lm_head"]}}


def _qkv_rows_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[q; k; v]`` rows -> GPT-NeoX's per-head ``[q_h; k_h; v_h]`` (transformers' fused layout)."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _sections(config: GPTConfig, module: str) -> list[int]:
    """The row sections of a fused projection, in our order (``[q, k, v]``, ``[gate, up]``)."""
    if module == "attention.query_key_value":
        return [config.arch.heads * config.head_dim] + [config.kv_heads * config.head_dim] * 2
    first = config.mlp_widths.first
    return [first // 2] * 2


def _factors(layer: str, weights: Mapping[str, torch.Tensor], names: PeftNames,
             config: GPTConfig) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(transformers module path, A, B) of each PEFT adapter that our adapter of ``layer`` is."""
    a, b = weights[f"{layer}.{ADAPTER}.lora_A"], weights[f"{layer}.{ADAPTER}.lora_B"]
    if layer == "output_layer":
        return [(f"base_model.model.{_HEAD[names]}", a, b)]
    _, index, module = layer.split(".", 2)  # layers, N, attention.dense
    hf = _MODULES[names].get(module, ())
    prefix = f"{_PREFIX[names]}.{index}"
    r = b.shape[1]
    if a.shape[0] > r:  # split by sections: A_s stacked, B's rows by section
        if len(hf) * r != a.shape[0]:
            raise ValueError(f"{names} has no module per section of {layer}")
        pieces = zip(hf, a.split(r, 0), b.split(_sections(config, module), 0))
        return [(f"{prefix}.{m}", a_s, b_s) for m, a_s, b_s in pieces]
    if len(hf) != 1:
        raise ValueError(f"{names} has no single module for the adapter of {layer}")
    if module == "attention.query_key_value":
        b = _qkv_rows_per_head(b, config.arch.heads)
    return [(f"{prefix}.{hf[0]}", a, b)]


def peft_state_dict(weights: Mapping[str, torch.Tensor], names: PeftNames, config: GPTConfig) -> Weights:
    """PEFT's names (and row order) for our adapters, ``layers.N.<module>.adapter.lora_X`` ->
    ``base_model.model.<model>.layers.N.<hf module>.lora_X.weight`` (one per section of a split adapter), the
    head's ``output_layer.adapter.lora_X`` -> ``base_model.model.lm_head.lora_X.weight`` (transformers 5's name of
    both models' head)."""
    out: Weights = {}
    for key in weights:
        if not key.endswith(f".{ADAPTER}.lora_A"):
            continue
        for module, a, b in _factors(key[: -len(f".{ADAPTER}.lora_A")], weights, names, config):
            out[f"{module}.lora_A.weight"] = a.detach().cpu().contiguous()
            out[f"{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    return out


def adapter_config(lora: LoRAArgs, names: PeftNames, base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json``: Levanter's values (``lora.py:504-516``; dropout written as 0.0 there too), the
    targets under the transformers model's module names."""
    targets = [m for t in lora.lora_target_modules for m in _PEFT_TARGET[names][t]]
    return {"base_model_name_or_path": base_model, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "lora_alpha": lora.lora_alpha, "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA",
            "r": lora.lora_r, "target_modules": targets, "task_type": "CAUSAL_LM"}


def write_adapter(directory: Path, tensors: Weights, config: dict[str, Any]) -> None:
    """The two files, in a directory that appears whole (a step written again, by a resumed run, replaces it)."""
    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    write_whole(directory, fill)


class PeftSaves(StepSaves):
    """The loop's hooks (``after_step``, ``at_exit``, ``resume``: ``step_saves.StepSaves``) that write the adapters
    of ``weights()``: the model's parameters, or the weight average's when there is one (Levanter's
    ``eval_model``)."""

    key = "lora_peft_save_path"

    def __init__(self, keys: PeftSaveArgs, lora: LoRAArgs, config: GPTConfig,
                 weights: Callable[[], Mapping[str, torch.Tensor]], base_model: str | None, writer: bool,
                 agree: Agree = alone, ema_beta: float | None = None) -> None:
        """``config``: the model (heads and sections order the fused rows); ``weights``: called on every rank at a
        save; ``base_model``: the adapter config's ``base_model_name_or_path`` (Levanter writes
        ``initialize_from_hf``); ``writer``: this rank writes (global rank 0); ``agree``: rank 0's answer on every
        rank (``mpu.rank0_decides``); ``ema_beta``: the adapters are the weight average's (said on the console)."""
        assert keys.lora_peft_save_path is not None
        super().__init__(keys.lora_peft_save_path, keys.lora_peft_save_interval, writer, agree)
        self.keys, self.lora, self.config = keys, lora, config
        self.weights, self.base_model, self.ema_beta = weights, base_model, ema_beta

    def _write(self, completed: int, target: Path) -> None:
        weights = self.weights()  # on every rank: under ZeRO-3 a gather all ranks take part in
        if not self.writer:
            return
        write_adapter(target, peft_state_dict(weights, self.keys.lora_peft_names, self.config),
                      adapter_config(self.lora, self.keys.lora_peft_names, self.base_model))

    def describe(self, completed: int, target: Path) -> str:
        what = (f"the weight average's (ema_beta {self.ema_beta}) of Deepy's {tag_for(completed)}"
                if self.ema_beta is not None else f"those of Deepy's {tag_for(completed)}")
        return (f"{self.key}: wrote {target}, the adapters after {completed} steps (Levanter's 0-based step "
                f"{levanter_step(completed)}): {what}")
