"""generate.py's work on each rank, and the model set-up eval.py shares with it.

`build_inference_model(run, ckpt, script)` builds the tokenizer and the model from the typed run views as
training does, without the training engine (no optimizer, no LR schedule, no `deepspeed.initialize`) except
for the checkpoints only the engine's loader reads (`generation.loading.engine_needed`), and loads `ckpt`'s
weights. `run_generation` runs `text_gen_type`'s mode on it. Reading the resolved config file and choosing
the checkpoint is the rank's program's (`megatron/app/workers.py`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed.accelerator
import torch
from torch import nn

from megatron.data.config import DataArgs
from megatron.engine.build import build_engine, build_model
from megatron.engine.process import limit_cpu_threads, speaks
from megatron.errors import ConfigError
from megatron.generation.config import TextgenArgs, batch_size, token_dataset_prefixes
from megatron.generation.loading import (
    engine_needed,
    load_committed_weights,
    load_full_weights,
    read_weights,
    run_name_of,
)
from megatron.generation.modes import TextGenerator, run_input_file, run_interactive, run_unconditional
from megatron.generation.precompute import precompute_all
from megatron.generation.replica import ModelReplica
from megatron.initialize import initialize
from megatron.logging.log import get_logger, setup_logging
from megatron.model.config import GPTConfig
from megatron.mpu import topology
from megatron.objectives import LMObjective, ObjectiveArgs
from megatron.tokenizer import Tokenizer, build_tokenizer
from megatron.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class InferenceModel:
    replica: ModelReplica
    tokenizer: Tokenizer
    step: int
    """Iteration of the checkpoint whose weights were loaded."""
    run_name: str | None = None
    """The training run that wrote that checkpoint (its ``TrainState.run_name``; None before runs had names)."""


def build_inference_model(run: EngineConfig, ckpt: Path, script: str, lora_changed: list[str]) -> InferenceModel:
    """Join the job, build the tokenizer and the model as training does (no optimizer, no DeepSpeed engine),
    load the weights of ``ckpt`` (a committed checkpoint's tag directory). ``run`` carries the checkpoint's
    LoRA settings; ``lora_changed`` names where they differ from the config's (logged)."""
    initialize(run.parallel, run.engine.seed)
    limit_cpu_threads()
    setup_logging(speaks())
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    padded_vocab = model_config.vocab
    if model_config.value_head:
        raise ConfigError(f"{script} needs a language model; this config builds a reward model (train_impl: rm), "
                          "whose value head scores sequences instead of predicting tokens")
    if lora_changed:
        get_logger().info("%s: LoRA adapters as %s saved them, not as the config says (%s)", script, ckpt,
                          ", ".join(lora_changed))
    reason = engine_needed(ckpt, run.parallel.moe_expert_parallel_size)
    if reason is not None:
        module, step = _engine_module(run, model_config, ckpt, padded_vocab, script, reason)
    else:
        module, is_pipe = build_model(model_config, run.parallel, run.activation_config,
                                      run.engine.keys.compile_layers, LMObjective(ObjectiveArgs()),
                                      run.lora if run.lora.lora_enabled else None)
        weights, step = read_weights(ckpt, model_config)
        load_full_weights(module, model_config, weights, tp=topology.get_tensor_model_parallel_world_size(),
                          tp_rank=topology.get_tensor_model_parallel_rank(), pipelined=is_pipe, source=ckpt)
        module.to(_device())
        get_logger().info("%s: weights of %s (iteration %d)", script, ckpt, step)
    replica = ModelReplica(module, vocab_size=tokenizer.vocab_size, hidden_size=model_config.arch.hidden)
    return InferenceModel(replica=replica, tokenizer=tokenizer, step=step, run_name=run_name_of(ckpt))


def _engine_module(run: EngineConfig, model_config: GPTConfig, ckpt: Path, padded_vocab: int, script: str,
                   reason: str) -> tuple[nn.Module, int]:
    """The model inside a training engine, loaded by the checkpoint loader: for the checkpoints whose `reason`
    the weights-only reader does not cover (see `generation.loading.engine_needed`)."""
    get_logger().info("%s: loading %s through the training engine (%s)", script, ckpt, reason)
    eng = build_engine(run, model_config, train_iters=run.engine.train_iters or 1)
    step = load_committed_weights(eng.engine, ckpt, {**run.args_record, "padded_vocab_size": padded_vocab}, script)
    return eng.engine.module, step


def _device() -> torch.device:
    return torch.device(deepspeed.accelerator.get_accelerator().current_device_name())  # patchable


def read_stdin_prompt() -> str | None:
    """One line from stdin (without its newline); None at end of input."""
    sys.stdout.write("prompt> ")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        sys.stdout.write("\n")
        return None
    return line.rstrip("\n")


def show_completion(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_generation(textgen: TextgenArgs, data: DataArgs, model_config: GPTConfig, micro_batch: int | None,
                   model: InferenceModel) -> None:
    """``text_gen_type``'s mode on ``model``: its keys (``textgen``), the datasets precompute reads (``data``), the
    sequence length and seed (``model_config``), and the micro-batch size, which sets the prompts per batch."""
    per_batch = batch_size(micro_batch)
    gen = TextGenerator(replica=model.replica, tokenizer=model.tokenizer, sampling=textgen.sampling(),
                        seq_length=int(model_config.seq_length or 0), batch_size=per_batch, seed=model_config.seed)
    match textgen.text_gen_type:
        case "unconditional":
            run_unconditional(gen, textgen)
        case "input-file":
            run_input_file(gen, textgen)
        case "interactive":
            run_interactive(gen, read_stdin_prompt, show_completion)
        case "precompute":
            assert textgen.precompute_model_name is not None
            precompute_all(model.replica, list(token_dataset_prefixes(data)), textgen.precompute_model_name,
                           batch_size=per_batch, max_length=gen.seq_length, eod=model.tokenizer.eod)
