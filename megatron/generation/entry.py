"""generate.py's work on each rank, and the model set-up eval.py shares with it.

`build_inference_model(args)` turns the resolved arguments (with the inference overrides) into the
typed run config and builds the tokenizer and the model as training does, without the training engine
(no optimizer, no LR schedule, no `deepspeed.initialize`) except for the checkpoints only the engine's
loader reads (`generation.loading.engine_needed`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron.errors import ConfigError
from megatron.generation.config import batch_size, checked, token_dataset_prefixes
from megatron.generation.replica import ModelReplica
from megatron.logging.log import get_logger
from megatron.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megatron.model import GPTConfig
    from megatron.neox_arguments import NeoXArgs
    from megatron.neox_arguments.run_config import RunConfig


def parse_worker_argv(argv: list[str], description: str) -> argparse.Namespace:
    """The worker command line deepy.py starts on each rank: `SCRIPT --deepy_config PATH`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--deepy_config", required=True, help="resolved config written by deepy.py")
    # DeepSpeed's launcher appends --local_rank=N; the rank comes from the environment instead
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class InferenceModel:
    replica: ModelReplica
    tokenizer: Tokenizer
    step: int
    """Iteration of the checkpoint whose weights were loaded."""
    run_name: str | None = None
    """The training run that wrote that checkpoint (its ``TrainState.run_name``; None before runs had names)."""


def build_inference_model(args: NeoXArgs, script: str) -> InferenceModel:
    """Join the job, build the tokenizer and the model as training does (no optimizer, no DeepSpeed engine),
    load the checkpoint's weights."""
    from megatron.generation.loading import (
        INFERENCE_OVERRIDES,
        committed_checkpoint,
        engine_needed,
        load_full_weights,
        read_weights,
        lora_differences,
        run_name_of,
        saved_lora,
    )
    from megatron.initialize import initialize
    from megatron.logging.log import setup_logging
    from megatron.mpu import topology
    from megatron.neox_arguments import deepspeed_config
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.tokenizer import build_tokenizer
    from megatron.training.engine import build_model
    from megatron.training.objectives import LMObjective, ObjectiveArgs
    from megatron.training.pretrain import limit_cpu_threads, speaks

    ckpt = committed_checkpoint(args.load, args.iteration, script)
    # the adapters as trained: the checkpoint's LoRA settings, whatever the config says (as the HF export does)
    lora = saved_lora(ckpt)
    changed = lora_differences(args, lora)
    inference_args = args.model_copy(update={**INFERENCE_OVERRIDES, **lora.settings()})  # the user's args stay untouched
    run = RunConfig(args=inference_args, deepspeed_config=deepspeed_config(inference_args),
                    args_record=inference_args.model_dump(mode="json"))
    initialize(run.parallel, run.training.seed)
    limit_cpu_threads()
    setup_logging(speaks())
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    padded_vocab = model_config.vocab
    if model_config.value_head:
        raise ConfigError(f"{script} needs a language model; this config builds a reward model (train_impl: rm), "
                          "whose value head scores sequences instead of predicting tokens")
    if changed:
        get_logger().info("%s: LoRA adapters as %s saved them, not as the config says (%s)", script, ckpt,
                          ", ".join(changed))
    reason = engine_needed(ckpt, inference_args.moe_expert_parallel_size)
    if reason is not None:
        module, step = _engine_module(run, model_config, ckpt, padded_vocab, script, reason)
    else:
        module, is_pipe = build_model(model_config, run.parallel, run.activation_config,
                                      run.training.loop.compile_layers, LMObjective(ObjectiveArgs()),
                                      run.lora if run.lora.lora_enabled else None)
        weights, step = read_weights(ckpt, model_config)
        load_full_weights(module, model_config, weights, tp=topology.get_tensor_model_parallel_world_size(),
                          tp_rank=topology.get_tensor_model_parallel_rank(), pipelined=is_pipe, source=ckpt)
        module.to(_device())
        get_logger().info("%s: weights of %s (iteration %d)", script, ckpt, step)
    replica = ModelReplica(module, vocab_size=tokenizer.vocab_size, hidden_size=model_config.arch.hidden)
    return InferenceModel(replica=replica, tokenizer=tokenizer, step=step, run_name=run_name_of(ckpt))


def _engine_module(run: RunConfig, model_config: GPTConfig, ckpt: Path, padded_vocab: int, script: str,
                   reason: str) -> tuple[nn.Module, int]:
    """The model inside a training engine, loaded by the checkpoint loader: for the checkpoints whose `reason`
    the weights-only reader does not cover (see `generation.loading.engine_needed`)."""
    from megatron.generation.loading import load_committed_weights
    from megatron.training.engine import build_engine

    get_logger().info("%s: loading %s through the training engine (%s)", script, ckpt, reason)
    eng = build_engine(run, model_config, train_iters=run.training.loop.train_iters or 1)
    step = load_committed_weights(eng.engine, ckpt, {**run.args_record, "padded_vocab_size": padded_vocab}, script)
    return eng.engine.module, step


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


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


def main(argv: list[str]) -> int:
    from megatron.generation.modes import TextGenerator, run_input_file, run_interactive, run_unconditional
    from megatron.generation.precompute import precompute_all
    from megatron.neox_arguments import load_resolved

    options = parse_worker_argv(argv, "Deepy text generation (started by deepy.py on each rank)")
    resolved = load_resolved(options.deepy_config).args
    args = resolved
    checked(args, args, args)  # a wrong textgen key fails before the model is built
    model = build_inference_model(resolved, "generate.py")
    per_batch = batch_size(args.train_micro_batch_size_per_gpu)
    gen = TextGenerator(replica=model.replica, tokenizer=model.tokenizer, sampling=args.sampling(),
                        seq_length=int(args.seq_length or 0), batch_size=per_batch, seed=args.seed)
    match args.text_gen_type:
        case "unconditional":
            run_unconditional(gen, args)
        case "input-file":
            run_input_file(gen, args)
        case "interactive":
            run_interactive(gen, read_stdin_prompt, show_completion)
        case "precompute":
            assert args.precompute_model_name is not None
            precompute_all(model.replica, list(token_dataset_prefixes(args)), args.precompute_model_name,
                           batch_size=per_batch, max_length=gen.seq_length, eod=model.tokenizer.eod)
    return 0
