"""``NeoXArgs``: every config key of a run as one flat, typed object.

Code reads ``args.hidden_size`` or ``args.train_batch_size`` without caring which group a key
belongs to, exactly as GPT-NeoX configs are written (one flat mapping). The groups stay separate
classes under ``groups/`` so each concept is documented in one small file; :class:`NeoXArgs` only
joins them and answers questions *about* keys (which group, what doc, supported or not).

What this module does not do: cross-field rules and derived values (``rules.py``/``derived.py``),
reading files (the loader). Per-field types, enums and ranges live on the fields themselves.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from megatron.errors import ConfigError
from megatron.neox_arguments.groups.deepspeed_config import DeepSpeedConfigArgs
from megatron.neox_arguments.groups.deepspeed_runner import DeepSpeedRunnerArgs
from megatron.neox_arguments.groups.logging import LoggingArgs
from megatron.neox_arguments.groups.lora import LoRAArgs
from megatron.neox_arguments.groups.lr import LRSchedulerArgs
from megatron.neox_arguments.groups.model import ModelArgs
from megatron.neox_arguments.groups.moe import MoEArgs
from megatron.neox_arguments.groups.optimizer import OptimizerArgs
from megatron.neox_arguments.groups.other import OtherArgs
from megatron.neox_arguments.groups.parallelism import ParallelismArgs
from megatron.neox_arguments.groups.support import UNSUPPORTED_ATTENTION_TYPES, unsupported_values
from megatron.neox_arguments.groups.textgen import TextgenArgs
from megatron.neox_arguments.groups.tokenizer import TokenizerArgs
from megatron.neox_arguments.groups.training import TrainingArgs
from megatron.neox_arguments.schema import ArgGroup
from megatron.neox_arguments.schema import is_supported as _field_is_supported

# Short group names (the module names under groups/) in documentation order.
GROUPS: dict[str, type[ArgGroup]] = {
    "parallelism": ParallelismArgs,
    "model": ModelArgs,
    "optimizer": OptimizerArgs,
    "lr": LRSchedulerArgs,
    "training": TrainingArgs,
    "logging": LoggingArgs,
    "tokenizer": TokenizerArgs,
    "textgen": TextgenArgs,
    "moe": MoEArgs,
    "lora": LoRAArgs,
    "other": OtherArgs,
    "deepspeed_config": DeepSpeedConfigArgs,
    "deepspeed_runner": DeepSpeedRunnerArgs,
}


def _owner_map(groups: Mapping[str, type[ArgGroup]]) -> dict[str, str]:
    """Map every field name to its group; two groups declaring one name is a schema bug.

    Multiple inheritance would silently let the later parent's field win, so the check must be
    explicit and happen before :class:`NeoXArgs` is built.
    """
    owner: dict[str, str] = {}
    for group_name, group in groups.items():
        for name in group.model_fields:
            if name in owner:
                raise TypeError(f"field {name!r} is in both {owner[name]} and {group_name}")
            owner[name] = group_name
    return owner


_OWNER: dict[str, str] = _owner_map(GROUPS)


class NeoXArgs(
    ParallelismArgs,
    ModelArgs,
    OptimizerArgs,
    LRSchedulerArgs,
    TrainingArgs,
    LoggingArgs,
    TokenizerArgs,
    TextgenArgs,
    MoEArgs,
    LoRAArgs,
    OtherArgs,
    DeepSpeedConfigArgs,
    DeepSpeedRunnerArgs,
):
    """All argument groups joined into one flat model (GPT-NeoX's 318 keys plus Deepy's extras).

    Instances are mutable on purpose: runtime values such as ``padded_vocab_size`` and
    ``iteration`` are assigned on the object while training runs.
    """

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every key, in group order."""
        return tuple(_OWNER)

    @classmethod
    def has_field(cls, name: str) -> bool:
        return name in _OWNER

    @classmethod
    def group_of(cls, name: str) -> str:
        """Short name of the group declaring ``name`` (``"model"``, ``"deepspeed_runner"``, ...)."""
        return _OWNER[cls._known(name)]

    @classmethod
    def doc_of(cls, name: str) -> str:
        """The field's docstring on one line."""
        description = cls.model_fields[cls._known(name)].description or ""
        return " ".join(description.split())

    @classmethod
    def default_of(cls, name: str) -> Any:
        return cls.model_fields[cls._known(name)].get_default(call_default_factory=True)

    @classmethod
    def is_supported(cls, name: str) -> bool:
        """False for keys accepted only at their default (features Deepy does not build yet)."""
        return _field_is_supported(cls, cls._known(name))

    @classmethod
    def unsupported_values(cls, name: str) -> tuple[Any, ...]:
        """Valid values of a supported key that Deepy still refuses (``norm: te_rmsnorm``)."""
        return unsupported_values(cls, cls._known(name))

    @classmethod
    def suggest(cls, name: str) -> list[str]:
        """Closest known keys to a misspelt ``name``, best first."""
        return difflib.get_close_matches(name.replace("-", "_"), _OWNER, n=3, cutoff=0.6)

    @classmethod
    def _known(cls, name: str) -> str:
        if name not in _OWNER:
            hint = cls.suggest(name)
            fix = f"did you mean {', '.join(hint)}?" if hint else "see configs/neox_arguments.md"
            raise ConfigError(f"unknown config key {name!r}: {fix}")
        return name


def check_supported(args: Mapping[str, Any] | BaseModel) -> list[str]:
    """Keys of ``args`` that ask for a feature Deepy does not support yet.

    ``args`` is a plain mapping of config keys (``-`` and ``_`` are equivalent, unknown keys are
    ignored here because the structure check reports them) or a validated :class:`NeoXArgs`. A key
    offends when its field is marked ``not_supported`` and its value differs from the default, when
    its value is one of the field's unsupported values, or (``attention_config``) when it names an
    attention type Deepy does not build.
    """
    items = args.model_dump().items() if isinstance(args, BaseModel) else args.items()
    offending: list[str] = []
    for raw_key, value in items:
        key = raw_key.replace("-", "_")
        if key not in _OWNER:
            continue
        if not NeoXArgs.is_supported(key):
            if value != NeoXArgs.default_of(key):
                offending.append(key)
        elif value in NeoXArgs.unsupported_values(key):
            offending.append(key)
        elif key == "attention_config" and _attention_types(value) & UNSUPPORTED_ATTENTION_TYPES:
            offending.append(key)
    return offending


def require_supported(args: Mapping[str, Any] | BaseModel) -> None:
    """Raise one :class:`ConfigError` naming every key from :func:`check_supported`."""
    items = dict(args.model_dump() if isinstance(args, BaseModel) else args)
    offending = check_supported(items)
    if not offending:
        return
    lines = []
    for key in offending:
        value = items.get(key, items.get(key.replace("_", "-")))
        if key == "attention_config":
            bad = sorted(_attention_types(value) & UNSUPPORTED_ATTENTION_TYPES)
            names = ", ".join(bad)
            lines.append(f"  {key}: attention type(s) {names} not supported yet; use global/local")
        elif not NeoXArgs.is_supported(key):
            lines.append(
                f"  {key}: {value!r} is not supported yet; remove the key "
                f"(only its default {NeoXArgs.default_of(key)!r} is accepted)"
            )
        else:
            lines.append(f"  {key}: {value!r} is not supported yet; choose another value")
    raise ConfigError("config asks for features Deepy does not support yet:\n" + "\n".join(lines))


def _attention_types(value: Any) -> set[str]:
    """Attention type names in a NeoX ``attention_config`` (``[[["global", "local"], 6], ...]``)."""
    types: set[str] = set()
    if not isinstance(value, list):
        return types
    for entry in value:
        if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], (list, tuple)):
            types.update(t for t in entry[0] if isinstance(t, str))
    return types
