"""``key=value`` overrides given after the config files on the command line.

The value is parsed as YAML (so ``lr=3e-4`` is a float, ``zero_optimization={stage: 1}`` a dict,
``log_dir=null`` a None), and a dotted key such as ``optimizer.params.lr=3e-4`` reaches inside a
dict-valued argument. Overrides are applied after every file, so they win over them; they are the one
way to set a key twice on purpose. They also win over a file's *other spelling* of the same setting
(:data:`SPELLINGS`: ``lr=0.01`` over the file's ``optimizer.params.lr``; ``precision`` and the
``fp16``/``bf16`` blocks): the file's value is taken out, and said (:func:`command_line_wins`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron.errors import ConfigError
from megatron.neox_arguments.keys import aliased_value, normalize_key, unknown_key_message
from megatron.config_rules import CLI, describe
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


SPELLINGS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("lr",), ("optimizer", "params", "lr")),
    (("weight_decay",), ("optimizer", "params", "weight_decay")),
    (("gradient_clipping",), ("clip_grad",), ("optimizer", "params", "max_grad_norm")),
    (("train_micro_batch_size_per_gpu",), ("batch_size",), ("per_device_parallelism",)),
)
"""Settings a config may write in more than one place (a flat key and a field of a block, or GPT-NeoX's
aliases); the rules refuse two of them that disagree, so a command-line value takes the files' out."""

_PRECISION_BLOCKS = {"fp16": "fp16", "bf16": "bfloat16"}


def _value_at(values: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = values
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _source_at(values: dict[str, Any], provenance: dict[str, str], path: tuple[str, ...]) -> str | None:
    """Where the value at ``path`` came from (the most specific provenance), None when it is not set."""
    if not _value_at(values, path)[0]:
        return None
    return next((provenance[".".join(path[:n])] for n in range(len(path), 0, -1) if ".".join(path[:n]) in provenance),
                None)


def _take_out(values: dict[str, Any], provenance: dict[str, str], path: tuple[str, ...]) -> None:
    if len(path) == 1:
        values.pop(path[0], None)
        provenance.pop(path[0], None)
        return
    parent = _value_at(values, path[:-1])[1]
    parent.pop(path[-1], None)


def command_line_wins(values: dict[str, Any], provenance: dict[str, str]) -> list[str]:
    """Take out of ``values`` each file's spelling of a setting the command line also gives (:data:`SPELLINGS`,
    and ``precision`` with the ``fp16``/``bf16`` blocks' ``enabled``); one line per value taken out, to say."""
    said: list[str] = []

    def replaced(path: tuple[str, ...], source: str, by: str) -> None:
        shown = ".".join(path)
        said.append(f"{shown}={_value_at(values, path)[1]!r} ({describe(source)}) is replaced by {by} from the "
                    f"command line: overrides win over the config files")

    for group in SPELLINGS:
        sources = {path: _source_at(values, provenance, path) for path in group}
        given = [path for path, source in sources.items() if source == CLI]
        if not given:
            continue
        by = f"{'.'.join(given[0])}={_value_at(values, given[0])[1]!r}"
        for path, source in sources.items():
            if source is not None and source != CLI:
                replaced(path, source, by)
                _take_out(values, provenance, path)
    # precision: one setting, spelled `precision` or as which of the fp16/bf16 blocks is enabled
    blocks = {name: _source_at(values, provenance, (name, "enabled")) for name in _PRECISION_BLOCKS}
    if provenance.get("precision") == CLI:
        precision = values["precision"]
        for name, source in blocks.items():
            wanted = precision == _PRECISION_BLOCKS[name]
            if source not in (None, CLI) and bool(values[name]["enabled"]) != wanted:
                replaced((name, "enabled"), source, f"precision={precision!r}")
                values[name]["enabled"] = wanted
    elif cli_blocks := [name for name, source in blocks.items() if source == CLI]:
        by = " and ".join(f"{name}.enabled={values[name]['enabled']!r}" for name in cli_blocks)
        if provenance.get("precision") is not None:
            replaced(("precision",), provenance["precision"], by)
            _take_out(values, provenance, ("precision",))  # derived again from the blocks
        if any(values[name]["enabled"] for name in cli_blocks):
            for name, source in blocks.items():
                if source not in (None, CLI) and values[name]["enabled"]:
                    replaced((name, "enabled"), source, by)
                    values[name]["enabled"] = False
    return said
