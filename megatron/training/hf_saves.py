"""Hugging Face model directories written while training, as Levanter's ``hf_save_path`` writes them.

When, where and what (stanford-crfm/levanter 9263f81e):
- ``trainer.add_hook(save_hf_checkpoint_callback(...), every=hf_save_steps)`` (``main/train_lm.py:214-222``,
  ``main/sft.py:290-300``; lora_lm.py's merged model: ``main/lora_lm.py:163-168``); a hook runs when
  ``info.step % every == 0`` (``trainer.py:97-100``) and once more, forced, after the last step
  (``trainer.py:448-449``), where ``info.step`` is the 0-based step just completed (``int(state.step) - 1``,
  ``callbacks/_core.py:37``); the callbacks skip ``info.step == 0`` (``compat/hf_checkpoints.py:1049-1050``,
  ``lora.py:437-438``).
- into ``<base>/step-<info.step>`` (``compat/hf_checkpoints.py:1058``, ``lora.py:446``), ``<base>`` being
  ``<hf_save_path>/<run id>`` unless ``trainer.checkpointer.append_run_id_to_base_path`` is false
  (``train_lm.py:206-209``, ``sft.py:292-295``; always with the run id for ``merged_hf_save_path``,
  ``lora_lm.py:164``): the dialect puts the run id into ``hf_save_path``, and the steps go below it;
- ``config.json``, the safetensors weights and the tokenizer's files (``save_pretrained``,
  ``compat/hf_checkpoints.py:754-954``), cast to ``hf_save_dtype`` when one is given (``_to_state_dict_with_dtype``,
  lines 223-252), written from ``step.eval_model`` (the weight average when there is one,
  ``trainer_state.py:82-94``).

Here rank 0 holds the whole model (tp 1, and no pipeline or one stage holding every layer: pp 0 or 1,
``hf_save_config.hf_save_layouts``; under ZeRO-3 every rank gathers it first; a ``PipelineModule``'s names are read
back as ``GPTModel``'s) and writes it with the HF exporter's pieces (``megatron/interop``, handed in by ``train.py``:
training does not import the converters); the step directory appears whole (written beside it, then renamed: a
reader never sees half of one). ``step-N`` holds the model after N + 1 steps, which Deepy's checkpoints call
``global_step{N+1}``: each save says so on the console where it is written (and whether it holds the weight
average). The rules that keep every rank in step (a save killed while writing, written again by the resumed run)
are ``step_saves.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron.checkpointing.commit import tag_for
from megatron.model.config import GPTConfig
from megatron.tokenizer.config import TokenizerArgs
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.step_saves import Agree, StepSaves, alone, levanter_step, write_whole
from megatron.training.step_saves import save_due, step_dir  # noqa: F401  (the hooks' step rule, read by tests)

Weights = Mapping[str, torch.Tensor]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class HFWriter(Protocol):
    """Writes a ``transformers`` model directory holding ``weights`` (full, under ``GPTModel``'s names, adapters
    included) into the empty directory ``out_dir``."""

    def __call__(self, weights: Weights, out_dir: Path) -> None: ...


class HFWriterFactory(Protocol):
    """Builds the writer for a model (``megatron.interop.hf_save_writer.HFModelWriter``, which ``train.py`` hands to
    ``pretrain``): it refuses a model or tokenizer it cannot write when built, before the first step.
    ``lora_scale``: the adapters are merged into their layers' weights with it; None: no adapters."""

    def __call__(self, config: GPTConfig, tokenizer: TokenizerArgs, dtype: torch.dtype,
                 lora_scale: float | None) -> HFWriter: ...


def save_dtype(keys: HFSaveArgs, precision: str | None) -> torch.dtype:
    """``hf_save_dtype``, else the training precision's dtype (``fp16``, ``bfloat16`` or fp32)."""
    if keys.hf_save_dtype is not None:
        return DTYPES[keys.hf_save_dtype]
    return {"fp16": torch.float16, "bfloat16": torch.bfloat16}.get(precision or "fp32", torch.float32)


class HFSaves(StepSaves):
    """The loop's hooks (``after_step``, ``at_exit``, ``resume``: ``step_saves.StepSaves``) that write the model of
    ``weights()``: the module's weights, with the weight average's in place of the trained ones when there is one
    (Levanter's ``eval_model``)."""

    key = "hf_save_path"

    def __init__(self, keys: HFSaveArgs, weights: Callable[[], Weights], writer: HFWriter | None,
                 agree: Agree = alone, ema_beta: float | None = None) -> None:
        """``writer``: None on the ranks that do not write; ``agree``: rank 0's answer on every rank
        (``mpu.rank0_decides``); ``ema_beta``: the weights are the weight average's (said where a save is written)."""
        assert keys.hf_save_path is not None
        super().__init__(keys.hf_save_path, keys.hf_save_interval, writer is not None, agree)
        self.keys, self.weights, self.writer_fn, self.ema_beta = keys, weights, writer, ema_beta

    def _write(self, completed: int, target: Path) -> None:
        weights = self.weights()  # on every rank: under ZeRO-3 a gather all ranks take part in
        if self.writer_fn is None:
            return
        full = {name: tensor.detach().cpu() for name, tensor in weights.items()}
        writer = self.writer_fn
        write_whole(target, lambda tmp: writer(full, tmp))

    def describe(self, completed: int, target: Path) -> str:
        """Which Deepy step the save is: Levanter names it by the 0-based step, Deepy's checkpoints by the steps
        taken, so ``step-N`` holds the weights of ``global_step{N+1}``."""
        what = (f"the weight average (ema_beta {self.ema_beta}) of Deepy's {tag_for(completed)}, not its trained "
                "weights" if self.ema_beta is not None else f"the weights of Deepy's {tag_for(completed)}")
        return (f"{self.key}: wrote {target}, the model after {completed} steps (Levanter's 0-based step "
                f"{levanter_step(completed)}): {what}")


def gathered_parameters(params: list[torch.nn.Parameter]) -> Callable[[], AbstractContextManager[Any]]:
    """A block inside which ZeRO-3's partitioned ``params`` are whole on every rank (every rank enters it; nothing
    is written back)."""
    # lazy: DeepSpeed; deepy.py reads save_dtype from here without it
    import deepspeed

    return lambda: deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def live_weights(module: torch.nn.Module, average: Callable[[], Weights] | None,
                 gathered: Callable[[], AbstractContextManager[Any]] | None = None,
                 keep: bool = True, rename: Callable[[str], str] | None = None) -> Callable[[], Weights]:
    """What a save writes: the module's state (its trained and frozen weights) with the average's tensors in place
    of the trained ones when there is one. ``gathered``: a block inside which the module's parameters are whole
    (ZeRO-3's ``GatheredParameters``, entered by every rank); ``keep``: this rank keeps a copy (the writer);
    ``rename``: the module's (and the average's) names -> ``GPTModel``'s (a one-stage ``PipelineModule``:
    ``megatron.model.pipeline.model_parameter_name``)."""
    def weights() -> Weights:
        if gathered is None:
            state = dict(module.state_dict())
        else:
            with gathered():
                state = {k: v.detach().clone() for k, v in module.state_dict().items()} if keep else {}
        if average is not None:
            state.update(average())
        return state if rename is None else {rename(name): tensor for name, tensor in state.items()}
    return weights
