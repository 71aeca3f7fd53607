"""generate.py's work on each rank, and the model set-up eval.py shares with it.

`build_inference_model(args)` turns the resolved arguments (with the inference overrides) into the
typed run config and builds the tokenizer and the model exactly as training does.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.errors import ConfigError
from megatron.generation.config import GenerationConfig
from megatron.generation.replica import ModelReplica
from megatron.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs


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


def build_inference_model(args: NeoXArgs, script: str) -> InferenceModel:
    """Join the job, build the tokenizer and the model as training does, load the checkpoint's weights."""
    from megatron.generation.loading import INFERENCE_OVERRIDES, load_committed_weights
    from megatron.initialize import initialize
    from megatron.logging.log import setup_logging
    from megatron.neox_arguments import deepspeed_config
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.tokenizer import build_tokenizer
    from megatron.training.engine import build_engine
    from megatron.training.pretrain import limit_cpu_threads, speaks

    inference_args = args.model_copy(update=INFERENCE_OVERRIDES)  # the user's args stay untouched
    run = RunConfig(args=inference_args, deepspeed_config=deepspeed_config(inference_args),
                    args_record=inference_args.model_dump(mode="json"))
    initialize(run.parallel, run.training.seed)
    limit_cpu_threads()
    setup_logging(speaks())
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    padded_vocab = model_config.padded_vocab_size
    if model_config.value_head:
        raise ConfigError(f"{script} needs a language model; this config builds a reward model (train_impl: rm), "
                          "whose value head scores sequences instead of predicting tokens")
    eng = build_engine(run, model_config, train_iters=run.training.train_iters or 1)
    step = load_committed_weights(eng.engine, run.checkpoint.load, run.checkpoint.iteration,
                                  {**run.args_record, "padded_vocab_size": padded_vocab}, script)
    replica = ModelReplica(eng.engine.module, vocab_size=tokenizer.vocab_size, hidden_size=eng.config.hidden_size)
    return InferenceModel(replica=replica, tokenizer=tokenizer, step=step)


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
    args = load_resolved(options.deepy_config).args
    config = GenerationConfig.from_args(args)  # a wrong textgen key fails before the model is built
    model = build_inference_model(args, "generate.py")
    gen = TextGenerator.from_config(model.replica, model.tokenizer, config)
    match config.text_gen_type:
        case "unconditional":
            run_unconditional(gen, config)
        case "input-file":
            run_input_file(gen, config)
        case "interactive":
            run_interactive(gen, read_stdin_prompt, show_completion)
        case "precompute":
            assert config.precompute_model_name is not None
            precompute_all(model.replica, list(config.data_prefixes), config.precompute_model_name,
                           batch_size=config.batch_size, max_length=config.seq_length, eod=model.tokenizer.eod)
    return 0
