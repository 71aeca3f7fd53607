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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel

from megatron import plugins
from megatron.errors import ConfigError
from megatron.neox_arguments.groups.deepspeed_config import DeepSpeedConfigArgs
from megatron.checkpointing.config import CheckpointArgs
from megatron.data.config import DataArgs
from megatron.data.stream_config import StreamArgs
from megatron.evaluation.config import EvalArgs
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.logging.config import LoggingArgs
from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.model.moe_config import MoEArgs
from megatron.model.mup_config import MupArgs
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.training.averaging_config import ModelAveragingArgs
from megatron.training.bad_steps import BadStepArgs
from megatron.training.curriculum import CurriculumArgs
from megatron.training.hang_config import HangArgs
from megatron.training.weight_server_config import WeightServerArgs
from megatron.training.stragglers import StragglerArgs
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.config import TrainingLoopArgs
from megatron.engine.config import EngineArgs
from megatron.engine.lr_config import LRSchedulerArgs
from megatron.engine.lr_dialects import LevanterScheduleArgs
from megatron.objectives.registry import DPOKeys, KTOKeys
from megatron.objectives.config import ObjectiveArgs
from megatron.engine.optimizer_config import OptimizerArgs
from megatron.neox_arguments.groups.other import OtherArgs
from megatron.mpu.parallel_config import ParallelismArgs
from megatron.config_support import OBSOLETE_ATTENTION_TYPES, UNSUPPORTED_ATTENTION_TYPES
from megatron.generation.config import TextgenArgs
from megatron.tokenizer.config import TokenizerArgs
from megatron.neox_arguments.groups.training import TrainingArgs
from megatron.config_schema import ArgGroup, own_fields
from megatron.config_schema import GpuLibrary, gpu_library, gpu_library_missing, obsolete_reason, unsupported_values
from megatron.config_schema import is_supported as _field_is_supported
from megatron.plugins import PluginArgs

# Short group names in documentation order: the module names under groups/, or, for a group declared
# beside the component that reads it, that component's name (checkpoint, logging, tokenizer, lora, lr,
# objective, data).
GROUPS: dict[str, type[ArgGroup]] = {
    "parallelism": ParallelismArgs,
    "model": GPTConfig,
    "optimizer": OptimizerArgs,
    "lr": LRSchedulerArgs,
    "training": TrainingArgs,
    "data": DataArgs,
    "streaming": StreamArgs,
    "training_loop": TrainingLoopArgs,
    "engine": EngineArgs,
    "model_averaging": ModelAveragingArgs,
    "bad_steps": BadStepArgs,
    "curriculum": CurriculumArgs,
    "hang": HangArgs,
    "weight_server": WeightServerArgs,
    "stragglers": StragglerArgs,
    "reinit_tokens": ReinitTokensArgs,
    "peft_saves": PeftSaveArgs,
    "hf_saves": HFSaveArgs,
    "objective": ObjectiveArgs,
    "activation_checkpointing": ActivationCheckpointArgs,
    "checkpoint": CheckpointArgs,
    "logging": LoggingArgs,
    "tokenizer": TokenizerArgs,
    "textgen": TextgenArgs,
    "evaluation": EvalArgs,
    "moe": MoEArgs,
    "mup": MupArgs,
    "lora": LoRAArgs,
    "other": OtherArgs,
    "deepspeed_config": DeepSpeedConfigArgs,
    "deepspeed_runner": DeepSpeedRunnerArgs,
    "plugins": PluginArgs,
}
"""The groups every run has; each registered plug-in adds its own keys as a group named
``family:name`` (``train_impl:dpo``), see :func:`schema_class`."""


def _owner_map(groups: Mapping[str, type[ArgGroup]]) -> dict[str, str]:
    """Map every field name to its group; two groups declaring one name is a schema bug.

    Multiple inheritance would silently let the later parent's field win, so the check must be
    explicit and happen before :class:`NeoXArgs` is built.
    """
    owner: dict[str, str] = {}
    for group_name, group in groups.items():
        for name in own_fields(group):
            if name in owner:
                raise TypeError(f"field {name!r} is in both {owner[name]} and {group_name}")
            owner[name] = group_name
    return owner


class _Arguments(
    ParallelismArgs,
    GPTConfig,
    OptimizerArgs,
    LRSchedulerArgs,
    TrainingArgs,
    DataArgs,
    StreamArgs,
    TrainingLoopArgs,
    EngineArgs,
    ModelAveragingArgs,
    BadStepArgs,
    CurriculumArgs,
    HangArgs,
    WeightServerArgs,
    StragglerArgs,
    ReinitTokensArgs,
    PeftSaveArgs,
    HFSaveArgs,
    ObjectiveArgs,
    ActivationCheckpointArgs,
    CheckpointArgs,
    LoggingArgs,
    TokenizerArgs,
    TextgenArgs,
    EvalArgs,
    MoEArgs,
    MupArgs,
    LoRAArgs,
    OtherArgs,
    DeepSpeedConfigArgs,
    DeepSpeedRunnerArgs,
    PluginArgs,
):
    """All argument groups joined into one flat model (GPT-NeoX's 318 keys plus Deepy's extras).

    Instances are mutable on purpose: runtime values such as ``padded_vocab_size`` and
    ``iteration`` are assigned on the object while training runs. :class:`NeoXArgs` is this class
    joined with the keys of Deepy's own plug-ins; :func:`schema_class` adds a user's.
    """

    _groups: ClassVar[dict[str, type[ArgGroup]]] = GROUPS
    _owner: ClassVar[dict[str, str]] = _owner_map(GROUPS)

    @classmethod
    def groups(cls) -> dict[str, type[ArgGroup]]:
        """Group name -> group class, the fixed groups first, then the plug-ins'."""
        return dict(cls._groups)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every key, in group order."""
        return tuple(cls._owner)

    @classmethod
    def has_field(cls, name: str) -> bool:
        return name in cls._owner

    @classmethod
    def group_of(cls, name: str) -> str:
        """Short name of the group declaring ``name`` (``"model"``, ``"deepspeed_runner"``, ...)."""
        return cls._owner[cls._known(name)]

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
    def obsolete_reason(cls, name: str) -> str | None:
        """Why the key (or its refused values) is obsolete, and what to use instead; None when it is not."""
        return obsolete_reason(cls, cls._known(name))

    @classmethod
    def gpu_library(cls, name: str) -> tuple[GpuLibrary, tuple[Any, ...]] | None:
        """The library running only on an NVIDIA GPU that the key (or, when listed, some of its values) needs
        (``needs_gpu_library`` in the schema); None for a key that needs none."""
        return gpu_library(cls, cls._known(name))

    @classmethod
    def needs_gpu_library(cls, name: str, value: Any) -> GpuLibrary | None:
        """The GPU-only library ``name: value`` needs to be built; None when it needs none (the default)."""
        found = cls.gpu_library(name)
        if found is None:
            return None
        library, values = found
        needs = value in values if values else value != cls.default_of(name)
        return library if needs else None

    @classmethod
    def unsupported_values(cls, name: str) -> tuple[Any, ...]:
        """Valid values of a supported key that Deepy still refuses (``norm: te_rmsnorm``)."""
        return unsupported_values(cls, cls._known(name))

    @classmethod
    def suggest(cls, name: str) -> list[str]:
        """Closest known keys to a misspelt ``name``, best first."""
        return difflib.get_close_matches(name.replace("-", "_"), cls._owner, n=3, cutoff=0.6)

    @classmethod
    def _known(cls, name: str) -> str:
        if name not in cls._owner:
            hint = cls.suggest(name)
            fix = f"did you mean {', '.join(hint)}?" if hint else "see configs/neox_arguments.md"
            raise ConfigError(f"unknown config key {name!r}: {fix}")
        return name


def _compose(base: type[NeoXArgs], extra: list[tuple[str, type[ArgGroup]]]) -> type[NeoXArgs]:
    groups = {**base._groups, **dict(extra)}
    namespace = {"__module__": __name__, "__qualname__": "NeoXArgs", "__doc__": NeoXArgs.__doc__,
                 "_groups": groups, "_owner": _owner_map(groups)}
    return type("NeoXArgs", (base, *(group for _, group in extra)), namespace)


plugins.require_tables()
_BUILTIN_PLUGIN_GROUPS = plugins.key_groups()


class NeoXArgs(_Arguments, LevanterScheduleArgs, DPOKeys, KTOKeys):
    """The argument object of every run: the fixed groups plus the keys of Deepy's own plug-ins.

    Declared here, not composed at run time, so a type checker reads every key; a user's plug-ins
    extend it in :func:`schema_class`.
    """

    _groups: ClassVar[dict[str, type[ArgGroup]]] = {**GROUPS, **dict(_BUILTIN_PLUGIN_GROUPS)}
    _owner: ClassVar[dict[str, str]] = _owner_map(_groups)


if [group for _, group in _BUILTIN_PLUGIN_GROUPS] != [LevanterScheduleArgs, DPOKeys, KTOKeys]:
    raise TypeError(
        "NeoXArgs' plug-in bases differ from the built-in plug-ins' key groups "
        f"{[name for name, _ in _BUILTIN_PLUGIN_GROUPS]}: list each one as a base of NeoXArgs"
    )

_COMPOSED: dict[tuple[type[ArgGroup], ...], type[NeoXArgs]] = {}


def schema_class() -> type[NeoXArgs]:
    """:data:`NeoXArgs`, joined with the keys of every plug-in registered since (a user's
    ``plugins:``); the same class for the same plug-ins."""
    known = {group for _, group in _BUILTIN_PLUGIN_GROUPS}
    extra = [(name, group) for name, group in plugins.key_groups() if group not in known]
    if not extra:
        return NeoXArgs
    key = tuple(group for _, group in extra)
    if key not in _COMPOSED:
        _COMPOSED[key] = _compose(NeoXArgs, extra)
    return _COMPOSED[key]


LibraryCheck = Callable[[GpuLibrary], str | None]
"""Why a GPU-only library cannot run here, or None (:func:`megatron.config_schema.gpu_library_missing`)."""


def check_supported(args: Mapping[str, Any] | BaseModel, missing: LibraryCheck = gpu_library_missing) -> list[str]:
    """Keys of ``args`` that ask for a feature Deepy does not support yet.

    ``args`` is a plain mapping of config keys (``-`` and ``_`` are equivalent, unknown keys are
    ignored here because the structure check reports them) or a validated :class:`NeoXArgs`. A key
    offends when its field is marked ``not_supported`` and its value differs from the default, when
    its value is one of the field's unsupported values, or (``attention_config``) when it names an
    attention type Deepy does not build; or when its value needs a library that runs only on an NVIDIA GPU
    and ``missing`` says this machine cannot run it.
    """
    items = args.model_dump().items() if isinstance(args, BaseModel) else args.items()
    offending: list[str] = []
    for raw_key, value in items:
        key = raw_key.replace("-", "_")
        if not NeoXArgs.has_field(key):
            continue
        library = NeoXArgs.needs_gpu_library(key, value)
        if library is not None:
            if missing(library) is not None:
                offending.append(key)
        elif not NeoXArgs.is_supported(key):
            if value != NeoXArgs.default_of(key):
                offending.append(key)
        elif value in NeoXArgs.unsupported_values(key):
            offending.append(key)
        elif key == "attention_config" and _attention_types(value) & UNSUPPORTED_ATTENTION_TYPES:
            offending.append(key)
    return offending


def require_supported(args: Mapping[str, Any] | BaseModel, missing: LibraryCheck = gpu_library_missing) -> None:
    """Raise one :class:`ConfigError` naming every key from :func:`check_supported`."""
    items = dict(args.model_dump() if isinstance(args, BaseModel) else args)
    offending = check_supported(items, missing)
    if not offending:
        return
    lines, gone, gpu = [], [], []
    for key in offending:
        value = items.get(key, items.get(key.replace("_", "-")))
        reason = NeoXArgs.obsolete_reason(key)
        library = NeoXArgs.needs_gpu_library(key, value)
        if library is not None:
            gpu.append(f"  {key}: {value!r} needs {library.name} (pip package {library.package}, "
                       f"requirements/requirements-kernels.txt) on an NVIDIA GPU; {missing(library)}")
        elif reason is not None:
            gone.append(f"  {key}: {value!r} is obsolete: {reason}")
        elif key == "attention_config":
            for name in sorted(_attention_types(value) & UNSUPPORTED_ATTENTION_TYPES):
                gone.append(f"  {key}: attention type {name} is obsolete: {OBSOLETE_ATTENTION_TYPES[name]}")
        elif not NeoXArgs.is_supported(key):
            lines.append(
                f"  {key}: {value!r} is not supported yet; remove the key "
                f"(only its default {NeoXArgs.default_of(key)!r} is accepted)"
            )
        else:
            lines.append(f"  {key}: {value!r} is not supported yet; choose another value")
    parts = ["config asks for features Deepy does not support yet:\n" + "\n".join(lines)] if lines else []
    parts += ["config sets obsolete keys:\n" + "\n".join(gone)] if gone else []
    parts += ["config asks for libraries that run only on an NVIDIA GPU:\n" + "\n".join(gpu)] if gpu else []
    raise ConfigError("\n".join(parts))


def _attention_types(value: Any) -> set[str]:
    """Attention type names in a NeoX ``attention_config`` (``[[["global", "local"], 6], ...]``)."""
    types: set[str] = set()
    if not isinstance(value, list):
        return types
    for entry in value:
        if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], (list, tuple)):
            types.update(t for t in entry[0] if isinstance(t, str))
    return types
