"""Which config keys do what: the one list of keys that are accepted but change nothing here, keys
Deepy fills in itself, and the machinery that proves every other key is read by a component.

Being read is necessary, not sufficient: :func:`keys_read` records which keys the component builders
(``RunConfig.from_args``, the DeepSpeed split, the launcher) and the derivations read, and
``tests/unit/test_config_honesty.py`` requires that of every supported key; it also requires a test
that observes each key's effect (``tests/unit/effect_index.py``; a key handed to DeepSpeed only counts
in a test that reads DeepSpeed's state), unless the key is listed below with the reason it changes
nothing. Keys of features not built are ``not_supported`` in the schema and refused before launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron.errors import DeepyError

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

_KERNEL_HINT = "selects a fused kernel in GPT-NeoX; Deepy's SDPA/torch.compile path computes the same maths"

NO_EFFECT_KEYS: dict[str, str] = {
    "scaled_upper_triang_masked_softmax_fusion": _KERNEL_HINT,
    "scaled_masked_softmax_fusion": _KERNEL_HINT,
    "bias_gelu_fusion": _KERNEL_HINT,
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


def only_default_accepted(name: str) -> bool:
    """A key whose every other value is refused ("not supported yet"): its default is what Deepy
    does, so it needs no reader (``moe_token_dropping: false``)."""
    import typing

    from megatron.neox_arguments.arguments import NeoXArgs

    refused = set(NeoXArgs.unsupported_values(name))
    if not refused:
        return False
    annotation = NeoXArgs.model_fields[name].annotation
    choices = {True, False} if annotation is bool else set(typing.get_args(annotation))
    return bool(choices) and choices - refused == {NeoXArgs.default_of(name)}
"""Filled-in keys a user may set (a label recorded with the run instead of the detected commit)."""


class ReadRecorder:
    """Wraps the arguments and records every attribute read (writes pass through)."""

    def __init__(self, args: NeoXArgs) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        if name in type(self._args).model_fields:
            self.read.add(name)
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


ComponentBuilder = Callable[[Any], object]


def component_builders() -> list[ComponentBuilder]:
    """Everything that turns keys into what a component does, for train.py."""
    from megatron.launcher.config import LaunchConfig
    from megatron.neox_arguments.deepspeed_split import deepspeed_config
    from megatron.neox_arguments.resolved import run_directory
    from megatron.neox_arguments.run_config import RunConfig

    return [RunConfig.from_args, deepspeed_config, LaunchConfig.from_args, run_directory]


def entry_point_builders() -> dict[str, ComponentBuilder]:
    """The typed configs of the other entry points, by script name (each also checks its keys
    before launch: see ``check_entry_point``)."""
    from megatron.evaluation.config import EvalConfig
    from megatron.generation.config import GenerationConfig

    return {"generate.py": GenerationConfig.from_args, "eval.py": EvalConfig.from_args}


def check_entry_point(args: NeoXArgs, user_script: str) -> None:
    """Build the typed config of ``user_script`` (generate.py, eval.py) so its mistakes are found
    before launch, like train.py's."""
    import os

    build = entry_point_builders().get(os.path.basename(user_script))
    if build is not None:
        if args.context_parallel_size > 1:  # decoding with a KV cache runs whole sequences on every rank
            from megatron.errors import ConfigError

            raise ConfigError(f"context_parallel_size={args.context_parallel_size} splits training sequences; "
                              f"{os.path.basename(user_script)} runs whole sequences: set context_parallel_size=1")
        build(args)


# Settings under which the builders read their conditional keys (a key read only when a feature is
# on, e.g. wandb_project when use_wandb): the harness builds each of these variants too.
FEATURE_VARIANTS: tuple[dict[str, Any], ...] = (
    {"use_wandb": True},
    {"text_gen_type": "unconditional", "eval_tasks": ["task"]},
)


def keys_read(args: NeoXArgs, world_size: int = 1) -> set[str]:
    """Keys the component builders (train.py's and the other entry points') and the derivations
    read from ``args`` (a finalized config) and from its FEATURE_VARIANTS."""
    from megatron.neox_arguments.derived import DERIVATIONS
    from megatron.neox_arguments.rules import RuleContext

    recorder = ReadRecorder(args)
    ctx = RuleContext(args=recorder, world_size=world_size)  # type: ignore[arg-type]
    for derive in DERIVATIONS:
        derive(ctx)
    read = set(recorder.read)
    for variant in ({}, *FEATURE_VARIANTS):
        variant_recorder = ReadRecorder(args.model_copy(update=variant))
        for build in component_builders():
            build(variant_recorder)
        if variant:
            for build in entry_point_builders().values():
                try:
                    build(variant_recorder)
                except DeepyError:
                    pass  # the variant does not suit this entry point; its reads so far still count
        read |= variant_recorder.read
    return read
