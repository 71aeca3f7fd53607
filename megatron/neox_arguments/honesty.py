"""Which config keys do what: the one list of keys that are accepted but change nothing here, and
keys Deepy fills in itself.

Every other key must be read by a component: ``tests/unit/key_reads.py`` records which keys the
component builders (``RunConfig``, the DeepSpeed split, the launcher, the entry points
below) and the derivations read, and ``tests/unit/test_config_honesty.py`` requires that of every
supported key; it also requires a test
that observes each key's effect (``tests/unit/effect_index.py``; a key handed to DeepSpeed only counts
in a test that reads DeepSpeed's state), unless the key is listed below with the reason it changes
nothing. Keys of features not built are ``not_supported`` in the schema and refused before launch.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from typing import Any

from megatron.errors import ConfigError
from megatron.evaluation.config import checked
from megatron.data.config import DataArgs
from megatron.generation.config import TextgenArgs
from megatron.generation.config import checked as generation_checked
from megatron.model.config import GPTConfig
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.component_groups import evaluation_run, group
from megatron.objective_needs import needs_of

_KERNEL_HINT = "selects a fused kernel in GPT-NeoX; Deepy's SDPA/torch.compile path computes the same maths"

NO_EFFECT_KEYS: dict[str, str] = {
    "scaled_upper_triang_masked_softmax_fusion": _KERNEL_HINT,
    "scaled_masked_softmax_fusion": _KERNEL_HINT,
    "bias_dropout_fusion": _KERNEL_HINT,
    "rope_fusion": _KERNEL_HINT,
    "layernorm_fusion": _KERNEL_HINT,
    "rmsnorm_fusion": _KERNEL_HINT,
    "use_flashattn_swiglu": _KERNEL_HINT,
    "fused_kernels_build_path": "Deepy builds no fused kernels of its own (they come with torch)",
    "apply_query_key_layer_scaling": "a fp16 overflow guard that is mathematically the identity; SDPA keeps "
                                     "the softmax in fp32 anyway",
    "attention_softmax_in_fp32": "always true here: SDPA accumulates the attention softmax in fp32",
    "use_cpu_initialization": "weights are always built in full from the seed, then sharded: the same "
                              "values wherever they are built",
    "output_layer_parallelism": "column is the only value, and what Deepy does",
    "data_impl": "mmap is the one on-disk format; infer finds it",
    "use_shared_fs": "the sample index is built under a file lock by the first rank that needs it, on "
                     "shared and node-local filesystems alike",
    "moe_type": "chooses the MoE library in earlier GPT-NeoX releases; both compute the dropless routing "
                "Deepy's layer computes",
    "enable_expert_tensor_parallelism": "how earlier GPT-NeoX placed experts over tensor-parallel ranks; Deepy "
                                        "places whole experts per rank, the same maths",
}
"""Keys accepted and changing nothing in Deepy, with why; ``--dry-run`` names those a config sets."""

FILLED_IN_KEYS: dict[str, str] = {
    "world_size": "the world size deepy.py checked; the ranks compare it with the real one",
    "global_num_gpus": "the world size, recorded",
    "is_pipe_parallel": "derived from pipe_parallel_size",
    "rank": "set by the launcher",
    "local_rank": "set by the launcher",
    "user_script": "the script deepy.py launches",
    "do_train": "whether a training split exists, found from the data",
    "do_valid": "whether a validation split exists, found from the data",
    "do_test": "whether a test split exists, found from the data",
    "git_hash": "the commit of the code that ran, recorded in deepy_config.json and checkpoints",
    "config_files": "the config files' text, recorded in deepy_config.json and checkpoints",
}
"""Keys Deepy fills in itself; a config setting them to something else is refused by a rule."""

USER_SETTABLE_FILLED_IN = frozenset({"git_hash"})
"""Filled-in keys a user may set (a label recorded with the run instead of the detected commit)."""


def only_default_accepted(name: str) -> bool:
    """A key whose every other value is refused ("not supported yet"): its default is what Deepy
    does, so it needs no reader (``moe_token_dropping: false``)."""
    refused = set(NeoXArgs.unsupported_values(name))
    if not refused:
        return False
    annotation = NeoXArgs.model_fields[name].annotation
    choices = {True, False} if annotation is bool else set(typing.get_args(annotation))
    return bool(choices) and choices - refused == {NeoXArgs.default_of(name)}


ComponentBuilder = Callable[[Any], object]


def entry_point_builders() -> dict[str, ComponentBuilder]:
    """The typed configs of the other entry points, by script name (each also checks its keys
    before launch: see ``check_entry_point``)."""
    return {"generate.py": lambda args: generation_checked(group(args, TextgenArgs), group(args, DataArgs),
                                                           group(args, GPTConfig)),
            "eval.py": lambda args: checked(evaluation_run(args))}


def check_entry_point(args: NeoXArgs, user_script: str) -> None:
    """Build the typed config of ``user_script`` (generate.py, eval.py) so its mistakes are found
    before launch, like train.py's."""
    build = entry_point_builders().get(os.path.basename(user_script))
    if build is not None:
        if args.context_parallel_size > 1:  # decoding with a KV cache runs whole sequences on every rank
            raise ConfigError(f"context_parallel_size={args.context_parallel_size} splits training sequences; "
                              f"{os.path.basename(user_script)} runs whole sequences: set context_parallel_size=1")

        if needs_of(args.train_impl).value_head:  # the ranks' build_inference_model refuses it after loading
            raise ConfigError(f"{os.path.basename(user_script)} needs a language model, and train_impl="
                              f"{args.train_impl!r} builds a reward model, whose value head scores sequences instead "
                              f"of predicting tokens: set train_impl: normal (or the objective the model was trained "
                              f"with, if it predicts tokens)")
        build(args)
