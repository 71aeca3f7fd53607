"""What ``generate.py`` and ``eval.py`` run on each rank: read the resolved config file deepy.py wrote, choose
the checkpoint, and hand generation and evaluation their typed parts.

The argument layer (``megatron.neox_arguments``) composes every component's keys; the components receive
their own groups (``RunConfig``'s parts, ``EvalRun``) and never read the config file themselves
(``tests/unit/test_import_graph.py``). ``train.py`` does the same for training. Everything is imported inside
the functions: ``--help`` needs none of it, and ``deepy.py``'s command (``app/deepy.py``) never imports this.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron.data.config import DataArgs
from megatron.evaluation.config import checked as evaluation_checked
from megatron.evaluation.entry import evaluate_checkpoint
from megatron.generation.config import TextgenArgs
from megatron.generation.config import checked as textgen_checked
from megatron.model.config import GPTConfig
from megatron.neox_arguments import deepspeed_config, load_resolved
from megatron.neox_arguments.component_groups import evaluation_run, group
from megatron.neox_arguments.run_config import RunConfig

if TYPE_CHECKING:
    from megatron.generation.entry import InferenceModel
    from megatron.neox_arguments import NeoXArgs


def parse_worker_argv(argv: list[str], description: str) -> argparse.Namespace:
    """The worker command line deepy.py starts on each rank: `SCRIPT --deepy_config PATH`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--deepy_config", required=True, help="resolved config written by deepy.py")
    # DeepSpeed's launcher appends --local_rank=N; the rank comes from the environment instead
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


def inference_model(args: NeoXArgs, script: str) -> InferenceModel:
    """The model ``script`` runs: the weights of ``load``'s newest committed checkpoint (or ``iteration``'s)
    with the LoRA adapters as they were trained, built without the training engine."""
    # lazy: torch and DeepSpeed load after the config is checked (a wrong key fails fast)
    from megatron.generation.entry import build_inference_model
    from megatron.generation.loading import INFERENCE_OVERRIDES, committed_checkpoint, lora_differences, saved_lora

    ckpt = committed_checkpoint(args.load, args.iteration, script)
    # the adapters as trained: the checkpoint's LoRA settings, whatever the config says (as the HF export does)
    lora = saved_lora(ckpt)
    inference_args = args.model_copy(update={**INFERENCE_OVERRIDES, **lora.settings()})  # the user's args stay untouched
    run = RunConfig.from_args(inference_args, deepspeed_config(inference_args))
    return build_inference_model(run, ckpt, script, lora_changed=lora_differences(args, lora))


def generate_main(argv: list[str]) -> int:
    """generate.py: ``text_gen_type``'s mode on the checkpoint in ``load``."""
    # lazy: torch and DeepSpeed load after the config is checked (a wrong key fails fast)
    from megatron.generation.entry import run_generation

    options = parse_worker_argv(argv, "Deepy text generation (started by deepy.py on each rank)")
    args = load_resolved(options.deepy_config).args
    textgen, data, model = group(args, TextgenArgs), group(args, DataArgs), group(args, GPTConfig)
    textgen_checked(textgen, data, model)  # a wrong textgen key fails before the model is built
    run_generation(textgen, data, model, args.train_micro_batch_size_per_gpu, inference_model(args, "generate.py"))
    return 0


def eval_main(argv: list[str]) -> int:
    """eval.py: the lm-eval tasks (``eval_tasks``) on the checkpoint in ``load``."""
    options = parse_worker_argv(argv, "Deepy evaluation with lm-evaluation-harness (started by deepy.py on each rank)")
    args = load_resolved(options.deepy_config).args
    config = evaluation_checked(evaluation_run(args))  # a wrong key fails before the model is built
    evaluate_checkpoint(config, inference_model(args, "eval.py"), checkpoint=args.load)
    return 0
