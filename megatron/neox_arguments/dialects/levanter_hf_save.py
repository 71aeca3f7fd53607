"""Levanter's Hugging Face saves while training: train_lm.py's and sft.py's ``hf_save_path``, ``hf_save_steps``,
``hf_save_dtype`` (train_lm only) and lora_lm.py's ``merged_hf_save_path``, onto Deepy's ``hf_save_path``,
``hf_save_interval``, ``hf_save_dtype`` (``megatron/training/hf_save_config.py``).

Read from stanford-crfm/levanter at 9263f81e:
- train_lm.py:55-58 (``hf_save_path`` None, ``hf_upload`` None, ``hf_save_steps`` 10000, ``hf_save_dtype`` None),
  204-222 (``<hf_save_path>/<run id>`` unless ``append_run_id_to_base_path`` is false; a dtype name ``jnp.dtype``
  rejects is warned about and dropped);
- sft.py:68-70 (``hf_save_steps`` 0; no ``hf_save_dtype`` field), 290-300 (the same path rule); a hook registered
  with ``every=0`` fails at the first step, ``info.step % 0`` (trainer.py:99);
- lora_lm.py:43-46 (``hf_save_steps`` 1000, shared with ``peft_save_path``), 163-168 (``<merged_hf_save_path>/<run
  id>``, always);
- ``save_pretrained`` with ``dtype`` None writes each parameter in its own dtype (compat/hf_checkpoints.py:223-252):
  the parameters' dtype of ``trainer.mp`` (``p=f32`` unless the policy is one dtype, jmp's ``bfloat16``).
"""

from __future__ import annotations

import os
from typing import Any

from megatron.neox_arguments.dialects import levanter_sft
from megatron.neox_arguments.dialects.common import Context, Refused, Rule, noted
from megatron.neox_arguments.dialects.levanter_trainer import run_id

TRAIN_LM_STEPS = 10000
"""train_lm.py:57@9263f81e."""
SFT_STEPS = 0
"""sft.py:70@9263f81e: with it, the hook's ``info.step % 0`` fails at the first step."""
LORA_STEPS = 1000
"""lora_lm.py:43@9263f81e."""

# jnp.dtype's names for the three dtypes Deepy writes (numpy's names, ml_dtypes' bfloat16)
_SAVE_DTYPES = {"float32": "fp32", "f4": "fp32", "single": "fp32", "float": "fp32", "bfloat16": "bf16",
                "float16": "fp16", "f2": "fp16", "half": "fp16"}
_MP_BF16 = {"bf16", "bfloat16"}


def _params_dtype(ctx: Context) -> str:
    """The dtype Levanter keeps the parameters in (``trainer.mp``'s ``p=``; one dtype for all: that one)."""
    text = str(ctx.value("trainer.mp", "f32")).replace(" ", "")
    if "=" not in text:
        return "bf16" if text in _MP_BF16 else "fp32"
    parts = dict(part.partition("=")[::2] for part in text.split(","))
    return "bf16" if (parts.get("p") or parts.get("params")) in _MP_BF16 else "fp32"


def _steps(ctx: Context) -> int:
    default = LORA_STEPS if levanter_sft.is_lora(ctx) else SFT_STEPS if levanter_sft.is_sft(ctx) else TRAIN_LM_STEPS
    return int(ctx.value("hf_save_steps", default))


def _dtype(ctx: Context) -> str:
    value = ctx.value("hf_save_dtype")
    if value is None:
        return _params_dtype(ctx)
    if str(value) not in _SAVE_DTYPES:
        raise Refused(f"hf_save_dtype {value!r}: Deepy writes {', '.join(sorted(_SAVE_DTYPES))} (jnp.dtype's names "
                      f"for fp32, bf16 and fp16); Levanter drops a name jnp.dtype does not know, with a warning")
    return _SAVE_DTYPES[str(value)]


def _save(path: str, ctx: Context, key: str) -> dict[str, Any]:
    steps = _steps(ctx)
    if steps <= 0:
        raise Refused(f"{key} with hf_save_steps {steps} (sft.py's default is 0): Levanter's hook runs at steps where "
                      f"step % hf_save_steps == 0, which fails at the first step; give hf_save_steps")
    return {"hf_save_path": path, "hf_save_interval": steps, "hf_save_dtype": _dtype(ctx)}


def _hf_save_path(value: Any, ctx: Context) -> dict[str, Any]:
    if value is None:
        return noted("no HF saves while training")
    if levanter_sft.is_lora(ctx):
        raise Refused("not a field of lora_lm.py's LoraLmConfig (lora_lm.py:33-49); its merged model is "
                      "merged_hf_save_path")
    base = str(value)
    if ctx.value("trainer.checkpointer.append_run_id_to_base_path", True):
        base = os.path.join(base, run_id(ctx))
    return _save(base, ctx, "hf_save_path")


def _hf_save_steps(value: Any, ctx: Context) -> dict[str, Any]:
    if ctx.value("peft_save_path") and levanter_sft.is_lora(ctx):  # lora_lm.py:43,157: the PEFT saves' interval
        return {"lora_peft_save_interval": int(value)} if value is not None else noted("Levanter's default, 1000")
    if ctx.value("hf_save_path") is not None or ctx.value("merged_hf_save_path"):
        return noted("the interval of the HF saves (set with the path: hf_save_interval)")
    return noted("no HF saves while training (hf_save_path is unset)")


def _hf_save_dtype(value: Any, ctx: Context) -> dict[str, Any]:
    if value is not None and (levanter_sft.is_sft(ctx) or levanter_sft.is_lora(ctx)):
        raise Refused("a field of train_lm.py only (train_lm.py:58); sft.py and lora_lm.py write the parameters' "
                      "dtype")
    if ctx.value("hf_save_path") is None:
        return noted("no HF saves while training (hf_save_path is unset)")
    return noted("the dtype of the HF saves (set with the path: hf_save_dtype)")


def _merged_hf_save_path(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return noted("unset")
    return _save(os.path.join(str(value), run_id(ctx)), ctx, "merged_hf_save_path")


TRAIN_LM_RULES: dict[str, Rule] = {
    "hf_save_path": _hf_save_path,
    "hf_save_steps": _hf_save_steps,
    "hf_save_dtype": _hf_save_dtype,
}
"""train_lm.py's keys (sft.py's too, but hf_save_dtype)."""
LORA_RULES: dict[str, Rule] = {"merged_hf_save_path": _merged_hf_save_path}
"""lora_lm.py's merged model."""
