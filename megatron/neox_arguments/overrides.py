"""``key=value`` overrides given after the config files on the command line.

The value is parsed as YAML (so ``lr=3e-4`` is a float, ``zero_optimization={stage: 1}`` a dict,
``log_dir=null`` a None), and a dotted key such as ``optimizer.params.lr=3e-4`` reaches inside a
dict-valued argument. Overrides are applied after every file, so they win over them; they are the one
way to set a key twice on purpose.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron.errors import ConfigError
from megatron.neox_arguments.keys import aliased_value, normalize_key, unknown_key_message
from megatron.config_rules import CLI
from megatron.neox_arguments.yaml_source import parse_yaml_text, plain

_KEY_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*$")


@dataclass(frozen=True)
class Override:
    """One parsed ``key=value``: ``path[0]`` is the argument, the rest reach into its dict value."""

    path: tuple[str, ...]
    value: Any
    text: str

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def looks_like_override(token: str) -> bool:
    return "=" in token


def parse_override(text: str) -> Override:
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"bad override '{text}': write key=value, e.g. train_iters=100")
    if not key:
        raise ConfigError(f"bad override '{text}': the key before '=' is missing; write key=value")
    if not _KEY_PATH.match(key):
        raise ConfigError(
            f"bad override '{text}': '{key}' is not a key; use letters, digits, '_' or '-', "
            "and '.' to reach inside a dict (optimizer.params.lr=3e-4)"
        )
    parts = key.split(".")
    value = plain(parse_yaml_text(value_text, f"override '{text}'"))
    if len(parts) == 1:
        value = aliased_value(parts[0], value)
    return Override(path=(normalize_key(parts[0]), *parts[1:]), value=value, text=text)


def parse_overrides(texts: Iterable[str]) -> list[Override]:
    overrides: list[Override] = []
    seen: dict[str, str] = {}
    for text in texts:
        override = parse_override(text)
        if override.dotted in seen:
            raise ConfigError(
                f"override '{override.dotted}' given twice on the command line: '{seen[override.dotted]}' "
                f"and '{text}'; keep one of them"
            )
        seen[override.dotted] = text
        overrides.append(override)
    return overrides


def apply_overrides(
    values: dict[str, Any],
    provenance: dict[str, str],
    overrides: Iterable[Override],
    field_names: Iterable[str],
    default_of: Callable[[str], Any],
) -> None:
    """Apply ``overrides`` in order to ``values`` (argument name -> value), recording ``cli`` provenance.

    ``default_of(name)`` supplies the starting value when a dotted override reaches into an argument
    that no file set.
    """
    names = list(field_names)
    known = set(names)
    for override in overrides:
        top = override.path[0]
        if top not in known:
            raise ConfigError(unknown_key_message(top, f"command-line override '{override.text}'", names))
        if len(override.path) == 1:
            values[top] = override.value
            provenance[top] = CLI
            # a whole new value replaces what earlier sub-key overrides recorded
            for key in [k for k in provenance if k.startswith(top + ".")]:
                del provenance[key]
            continue
        current = values[top] if top in values else copy.deepcopy(default_of(top))
        values[top] = _set_path(current, override, provenance.get(top, "its default"))
        provenance.setdefault(top, CLI)
        provenance[override.dotted] = CLI


def _set_path(root: Any, override: Override, root_source: str) -> dict[str, Any]:
    """``root`` with ``override.value`` set at ``override.path[1:]``, creating missing levels."""
    if root is None:
        root = {}
    node = root
    for depth, part in enumerate(override.path[1:], start=1):
        if not isinstance(node, dict):
            reached = ".".join(override.path[:depth])
            raise ConfigError(
                f"bad override '{override.text}': '{reached}' is {node!r} (from {root_source}), not a "
                f"dict, so '{override.dotted}' cannot reach inside it; set '{reached}=...' instead"
            )
        if depth == len(override.path) - 1:
            node[part] = override.value
        else:
            node = node.setdefault(part, {})
    return root
