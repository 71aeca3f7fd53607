"""Marks for fields that Deepy accepts only partly.

:func:`megatron.config_schema.not_supported` marks a whole field as "default only". Some
fields are supported except for a few of their values (``norm: te_rmsnorm`` needs Transformer
Engine, ``train_impl: reinforce`` needs an online rollout server). Refusing those values is still a
*support* question, not a type question: the value is a valid GPT-NeoX value, so the schema keeps it
in the ``Literal`` (configs written for GPT-NeoX still parse) and :func:`unsupported_values` lets
the support check in ``arguments.py`` reject it with a "not supported yet" message.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

UNSUPPORTED_VALUES_KEY = "deepy_unsupported_values"

# Attention types a GPT-NeoX attention_config may name that Deepy's model does not build. "global",
# "local" (sliding window) and "flash" (an implementation of global attention) are supported.
UNSUPPORTED_ATTENTION_TYPES: frozenset[str] = frozenset(
    {
        "sparse_fixed",
        "sparse_variable",
        "bigbird",
        "bslongformer",
        "gmlp",
        "amlp",
        "rwkv",
        "mamba",
        "ring",
    }
)
KNOWN_ATTENTION_TYPES: frozenset[str] = UNSUPPORTED_ATTENTION_TYPES | {"global", "local", "flash"}


def partly_supported(default: Any, unsupported: tuple[Any, ...], **constraints: Any) -> Any:
    """A field whose values in ``unsupported`` are "not supported yet"; other values are fine."""
    extra = {UNSUPPORTED_VALUES_KEY: list(unsupported)}
    return Field(default, json_schema_extra=extra, **constraints)  # type: ignore[arg-type]


def unsupported_values(group: type[BaseModel], name: str) -> tuple[Any, ...]:
    """The values of ``group.name`` that Deepy refuses; empty when every valid value is fine."""
    extra = group.model_fields[name].json_schema_extra
    if isinstance(extra, dict):
        values = extra.get(UNSUPPORTED_VALUES_KEY)
        if isinstance(values, list):
            return tuple(values)
    return ()
