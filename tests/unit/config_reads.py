"""Which config keys the components read: the recorder behind the honesty test's "read by a component" check.

:func:`keys_read` wraps a finalized config in a :class:`ReadRecorder`, runs the derivations and every
component builder (``RunConfig.from_args``, the DeepSpeed split, the launcher, the run directory, and
the other entry points' configs under :data:`FEATURE_VARIANTS`), and returns the keys they read.
"""

from __future__ import annotations

import typing
from typing import Any

from megatron.errors import DeepyError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.honesty import ComponentBuilder, entry_point_builders


def only_default_accepted(name: str) -> bool:
    """A key whose every other value is refused ("not supported yet"): its default is what Deepy
    does, so it needs no reader (``moe_token_dropping: false``)."""
    refused = set(NeoXArgs.unsupported_values(name))
    if not refused:
        return False
    annotation = NeoXArgs.model_fields[name].annotation
    choices = {True, False} if annotation is bool else set(typing.get_args(annotation))
    return bool(choices) and choices - refused == {NeoXArgs.default_of(name)}


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


def component_builders() -> list[ComponentBuilder]:
    """Everything that turns keys into what a component does, for train.py."""
    from megatron.launcher.config import LaunchConfig
    from megatron.neox_arguments.deepspeed_split import deepspeed_config
    from megatron.neox_arguments.resolved import run_directory
    from megatron.neox_arguments.run_config import RunConfig

    return [RunConfig.from_args, deepspeed_config, LaunchConfig.from_args, run_directory]


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
