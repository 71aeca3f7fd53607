"""Where each argument value came from, and the table ``deepy.py --dry-run`` prints.

Provenance is a plain ``dict[str, str]``: argument name -> ``"configs/125M.yml:12"`` (file and line),
``"cli"`` (a ``key=value`` override) or ``"derived"`` (computed by the rules). A name that is absent
kept its default. Dotted names (``"optimizer.params.lr"``) record an override that reached inside a
dict-valued argument; the argument itself keeps the source of the rest of its value.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from megatron.config_rules import CLI, DEFAULT, DERIVED

# arguments never shown in the table: they hold whole files, not settings
HIDDEN_IN_TABLE = frozenset({"config_files"})
MAX_VALUE_WIDTH = 48


def describe_source(source: str) -> str:
    """A provenance value as it reads in an error message."""
    return {CLI: "the command line", DEFAULT: "its default", DERIVED: "a derived value"}.get(source, source)


def field_default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].get_default(call_default_factory=True)


def non_default_values(args: BaseModel) -> dict[str, Any]:
    """Arguments whose value differs from the schema default, in schema order."""
    model = type(args)
    changed: dict[str, Any] = {}
    for name in model.model_fields:
        value = getattr(args, name)
        if value != field_default(model, name):
            changed[name] = value
    return changed


def _render(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:  # a list of blocks (tracker: [{type: wandb}, ...]) as their fields too
        return json.dumps(value, sort_keys=False,
                          default=lambda v: v.model_dump(mode="json") if isinstance(v, BaseModel) else str(v))
    except (TypeError, ValueError):
        return repr(value)


def resolved_rows(args: BaseModel, provenance: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(key, value, source)`` for every non-default or user-set value, sub-key overrides after their key.

    A value that differs from its default but has no recorded source was computed by the rules, so it
    is shown as ``derived``.
    """
    shown = dict(non_default_values(args))
    for key in provenance:
        if "." not in key and key in type(args).model_fields:
            shown.setdefault(key, getattr(args, key))
    model = type(args)
    # the schema's own order (grouped: parallelism, model, optimizer, ...) reads better than pydantic's
    order = list(model.field_names()) if hasattr(model, "field_names") else list(model.model_fields)
    rows: list[tuple[str, str, str]] = []
    for key in sorted(shown, key=order.index):
        if key in HIDDEN_IN_TABLE:
            continue
        rows.append((key, _render(shown[key]), provenance.get(key, DERIVED)))
        for sub_key in sorted(k for k in provenance if k.startswith(key + ".")):
            rows.append((sub_key, _render(_dig(shown[key], sub_key.split(".")[1:])), provenance[sub_key]))
    return rows


def _dig(value: Any, path: list[str]) -> Any:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def format_resolved_table(args: BaseModel, provenance: dict[str, str]) -> str:
    """Aligned ``key  value  source`` lines; long values overflow their column rather than wrap."""
    rows = resolved_rows(args, provenance)
    if not rows:
        return "(every argument is at its default)"
    key_width = max(len(key) for key, _, _ in rows)
    value_width = min(MAX_VALUE_WIDTH, max(len(value) for _, value, _ in rows))
    lines = []
    for key, value, source in rows:
        lines.append(f"{key:<{key_width}}  {value:<{value_width}}  {source}".rstrip())
    return "\n".join(lines)
