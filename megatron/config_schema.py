"""The building block of the argument schema.

Each argument group (model, parallelism, optimizer, ...) is an :class:`ArgGroup` subclass, declared
beside the component that reads it or under ``megatron/neox_arguments/groups/``; a plug-in declares its
own (``megatron/plugins.py``). It sits below every component and the argument layer. Every field has a type, a default and a one-line
docstring right under it; pydantic reads that docstring as the field's description, so the generated
docs and ``--help`` come from the same text::

    class ModelArgs(ArgGroup):
        hidden_size: int | None = None
        \"\"\"Transformer hidden size.\"\"\"

A field whose feature Deepy does not implement yet is declared with :func:`not_supported`: it is
accepted at its default, and setting it to anything else is a clear "not supported yet" error; one
supported except for a few of its values (``train_impl: reinforce``) with :func:`partly_supported`; one
gone from the anchors with :func:`obsolete`; one built with a library that runs only on an NVIDIA GPU
(Transformer Engine, bitsandbytes) with :func:`needs_gpu_library`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED_KEY = "deepy_supported"
UNSUPPORTED_VALUES_KEY = "deepy_unsupported_values"
OBSOLETE_KEY = "deepy_obsolete"
GPU_LIBRARY_KEY = "deepy_gpu_library"
GPU_LIBRARY_VALUES_KEY = "deepy_gpu_library_values"


class ArgGroup(BaseModel):
    """Base of every argument group: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=False,
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )


def own_fields(group: type[BaseModel]) -> list[str]:
    """The fields ``group`` declares itself, not those it inherits from another argument group (the
    model's ``GPTConfig`` includes the MoE layer's keys, declared by ``MoEArgs``)."""
    inherited = {name for base in group.__mro__[1:]
                 if isinstance(base, type) and issubclass(base, ArgGroup) for name in base.model_fields}
    return [name for name in group.model_fields if name not in inherited]


def not_supported(default: Any) -> Any:
    """A field accepted only at ``default``: any other value is a "not supported yet" error."""
    return Field(default, json_schema_extra={SUPPORTED_KEY: False})


def obsolete(default: Any, reason: str, values: tuple[Any, ...] = ()) -> Any:
    """A GPT-NeoX key (or, with ``values``, some of its values) for something gone from the anchors or never
    used by their training: accepted at ``default``, anything else (those ``values``) refused with ``reason``,
    which says why and what to use instead. Not "not supported yet": nothing is planned to build it."""
    extra: dict[str, Any] = {OBSOLETE_KEY: reason}
    if values:
        extra[UNSUPPORTED_VALUES_KEY] = list(values)
    else:
        extra[SUPPORTED_KEY] = False
    return Field(default, json_schema_extra=extra)


def obsolete_reason(group: type[BaseModel], name: str) -> str | None:
    """Why ``group.name`` (or its refused values) is obsolete; None for a key that is not."""
    extra = group.model_fields[name].json_schema_extra
    reason = extra.get(OBSOLETE_KEY) if isinstance(extra, dict) else None
    return reason if isinstance(reason, str) else None


@dataclass(frozen=True)
class GpuLibrary:
    """A library that runs only on an NVIDIA GPU (CUDA kernels, no CPU path), pinned in
    ``requirements/requirements-kernels.txt``; the keys that need it are marked with
    :func:`megatron.config_schema.needs_gpu_library`."""

    name: str
    """How people call it: ``Transformer Engine``."""
    package: str
    """Its pip package: ``transformer-engine``."""
    module: str
    """Its import name: ``transformer_engine``."""


TRANSFORMER_ENGINE = GpuLibrary("Transformer Engine", "transformer-engine", "transformer_engine")
"""NVIDIA's fused (and FP8) transformer layers: the ``te_*`` keys and ``norm: te_rmsnorm|te_layernorm``."""
BITSANDBYTES = GpuLibrary("bitsandbytes", "bitsandbytes", "bitsandbytes")
"""8-bit optimizers: ``use_bnb_optimizer``."""


def gpu_library_missing(library: GpuLibrary) -> str | None:
    """Why ``library`` cannot run on this machine ("this machine has no GPU", "the library is not installed",
    or both), or None where it can."""
    # lazy: torch; asked only when a config sets a key that needs a GPU library
    import torch

    reasons = [] if torch.cuda.is_available() else ["this machine has no GPU"]
    if importlib.util.find_spec(library.module) is None:
        reasons.append("the library is not installed")
    return " and ".join(reasons) or None


def needs_gpu_library(default: Any, library: GpuLibrary, values: tuple[Any, ...] = ()) -> Any:
    """A GPT-NeoX key (or, with ``values``, some of its values) that Deepy builds with ``library``, which runs
    only on an NVIDIA GPU: accepted at ``default`` everywhere; anything else (those ``values``) only where the
    library is installed and a GPU is present, refused before launch elsewhere (``arguments.check_supported``)."""
    extra: dict[str, Any] = {GPU_LIBRARY_KEY: {"name": library.name, "package": library.package,
                                               "module": library.module}}
    if values:
        extra[GPU_LIBRARY_VALUES_KEY] = list(values)
    return Field(default, json_schema_extra=extra)


def gpu_library(group: type[BaseModel], name: str) -> tuple[GpuLibrary, tuple[Any, ...]] | None:
    """The GPU-only library ``group.name`` needs, and the values that need it (empty: every value but the
    default); None for a key that needs none."""
    extra = group.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get(GPU_LIBRARY_KEY), dict):
        return None
    spec = extra[GPU_LIBRARY_KEY]
    assert isinstance(spec, dict)
    values = extra.get(GPU_LIBRARY_VALUES_KEY)
    library = GpuLibrary(str(spec["name"]), str(spec["package"]), str(spec["module"]))
    return library, tuple(values) if isinstance(values, list) else ()


def is_supported(group: type[BaseModel], name: str) -> bool:
    extra = group.model_fields[name].json_schema_extra
    return not (isinstance(extra, dict) and extra.get(SUPPORTED_KEY) is False)


def partly_supported(default: Any, unsupported: tuple[Any, ...], **constraints: Any) -> Any:
    """A field whose values in ``unsupported`` are "not supported yet"; other values are fine.

    Refusing those values is a *support* question, not a type question: each is a valid GPT-NeoX
    value, so the field still accepts it (GPT-NeoX configs still parse) and the support check
    (``NeoXArgs.unsupported_values``) refuses it with a "not supported yet" message."""
    extra = {UNSUPPORTED_VALUES_KEY: list(unsupported)}
    # arg-type: pydantic's Field overloads cannot match constraints passed through **kwargs
    return Field(default, json_schema_extra=extra, **constraints)  # type: ignore[arg-type]


def unsupported_values(group: type[BaseModel], name: str) -> tuple[Any, ...]:
    """The values of ``group.name`` that Deepy refuses; empty when every valid value is fine."""
    extra = group.model_fields[name].json_schema_extra
    if isinstance(extra, dict):
        values = extra.get(UNSUPPORTED_VALUES_KEY)
        if isinstance(values, list):
            return tuple(values)
    return ()
