"""Reading one config file into plain data that remembers where each key was written.

PyYAML's ``SafeLoader`` already refuses to build Python objects, but it forgets line numbers, lets a
duplicate key silently win, reads ``1e-4`` as a string (YAML 1.1 wants a dot in a float), turns
``2024-01-01`` into a date and knows no ``!include``. :class:`ConfigLoader` is a ``SafeLoader``
subclass that fixes exactly those things; everything else (anchors, merge keys, JSON, which is YAML)
behaves as usual.

Mappings come back as :class:`LocatedDict`, a ``dict`` that also knows the file it came from and
the line of each key, so later layers can name ``file:line`` in their messages.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

from megatron.errors import ConfigError

INCLUDE_TAG = "!include"
CONFIG_SUFFIXES = (".yml", ".yaml", ".json")

# YAML 1.1 (PyYAML) only reads "1.0e-4" as a float; users write "1e-4" and mean a number.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def resolve_config_path(name: str, conf_dir: str | None = None) -> str:
    """GPT-NeoX style: ``-d configs 125M`` finds ``configs/125M.yml``; the suffix is optional."""
    base = os.path.join(conf_dir, name) if conf_dir else name
    candidates = [base]
    if not base.endswith(CONFIG_SUFFIXES):
        candidates += [base + suffix for suffix in CONFIG_SUFFIXES]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    tried = ", ".join(candidates)
    raise ConfigError(
        f"config file not found: {name} (looked for {tried}); "
        "overrides go after the config files and are written key=value"
    )


class LocatedDict(dict):
    """A mapping read from a file: ``lines[key]`` is the 1-based line where ``key`` was written."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.lines: dict[Any, int] = {}

    def where(self, key: Any) -> str:
        """``file:line`` of ``key``, or just the file when the line is unknown."""
        line = self.lines.get(key)
        return f"{self.source}:{line}" if line is not None else self.source


def _where(source: str, node: Node) -> str:
    mark = node.start_mark
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


class ConfigLoader(yaml.SafeLoader):
    """Safe YAML with key lines, duplicate-key errors, ``!include`` and exponent floats."""

    def __init__(self, text: str, source: str, files: dict[str, str], stack: tuple[str, ...]) -> None:
        super().__init__(text)
        self.source = source
        # display path -> text of every file read, includes too (kept for the resolved config)
        self.files = files
        # real paths of the files being read, outermost first, to detect include cycles
        self.stack = stack

    # --- mappings: remember lines, refuse duplicates -------------------------------------------------
    def construct_located_map(self, node: MappingNode) -> Iterator[LocatedDict]:
        data = LocatedDict(self.source)
        yield data
        own_keys = {id(key_node) for key_node, _ in node.value}
        self.flatten_mapping(node)  # resolves "<<" merge keys; merged pairs come first
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise ConfigError(
                    f"{_where(self.source, key_node)}: a mapping key must be a plain value, got {key!r}"
                ) from None
            if id(key_node) in own_keys:
                line = key_node.start_mark.line + 1
                if key in data.lines:
                    raise ConfigError(
                        f"duplicate key '{key}': set at {self.source}:{data.lines[key]} "
                        f"and again at {self.source}:{line}; keep one of them"
                    )
                data.lines[key] = line
            # a key merged in with "<<" may be overridden by an own key; it has no line of its own
            data[key] = self.construct_object(value_node, deep=True)
        for key in data:
            data.lines.setdefault(key, node.start_mark.line + 1)

    # --- tags we refuse ------------------------------------------------------------------------------
    def refuse_python_tag(self, suffix: str, node: Node) -> Any:
        raise ConfigError(
            f"{_where(self.source, node)}: the tag '{node.tag}' would build a Python object; "
            "configs are loaded as safe YAML only - write a plain value instead"
        )

    def refuse_unknown_tag(self, node: Node) -> Any:
        raise ConfigError(
            f"{_where(self.source, node)}: unknown YAML tag '{node.tag}'; the only tag Deepy knows is {INCLUDE_TAG}"
        )

    # --- !include ------------------------------------------------------------------------------------
    def construct_include(self, node: Node) -> Any:
        if not isinstance(node, ScalarNode) or not node.value:
            raise ConfigError(f"{_where(self.source, node)}: write {INCLUDE_TAG} followed by a file name")
        target = os.path.normpath(os.path.join(os.path.dirname(self.source), node.value))
        if not os.path.isfile(target):
            raise ConfigError(f"{_where(self.source, node)}: {INCLUDE_TAG} file not found: {target}")
        real = os.path.realpath(target)
        if real in self.stack:
            chain = " -> ".join([*self.stack[self.stack.index(real):], real])
            raise ConfigError(f"{_where(self.source, node)}: {INCLUDE_TAG} cycle: {chain}")
        return load_yaml_file(target, self.files, self.stack)


ConfigLoader.add_constructor("tag:yaml.org,2002:map", ConfigLoader.construct_located_map)
ConfigLoader.add_constructor(INCLUDE_TAG, ConfigLoader.construct_include)
ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", ConfigLoader.refuse_python_tag)
ConfigLoader.add_constructor(None, ConfigLoader.refuse_unknown_tag)
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
# An unquoted 2024-01-01 stays text: run names and paths are strings, and a date object is neither
# a valid str field nor JSON. (add_implicit_resolver above gave this class its own resolver table.)
for _first, _resolvers in ConfigLoader.yaml_implicit_resolvers.items():
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != "tag:yaml.org,2002:timestamp"]


def _malformed(source: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    detail = f"{problem} ({context})" if context else problem
    return ConfigError(f"{where}: malformed YAML: {detail}")


def parse_yaml_text(text: str, source: str, files: dict[str, str] | None = None,
                    stack: tuple[str, ...] = ()) -> Any:
    """Parse one YAML/JSON document; ``source`` names it in messages (a path or ``"cli"``)."""
    loader = ConfigLoader(text, source, {} if files is None else files, stack)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise _malformed(source, err) from err
    finally:
        loader.dispose()


def load_yaml_file(path: str, files: dict[str, str] | None = None, stack: tuple[str, ...] = ()) -> Any:
    """Read ``path``; its text (and those of files it includes) is recorded in ``files``."""
    files = {} if files is None else files
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    files[path] = text
    return parse_yaml_text(text, path, files, (*stack, os.path.realpath(path)))


def plain(value: Any) -> Any:
    """The same data with every :class:`LocatedDict` turned into a plain ``dict`` (for pydantic/JSON)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value
