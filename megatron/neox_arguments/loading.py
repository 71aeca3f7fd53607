"""Config files + overrides -> one validated :class:`ResolvedConfig` (the structure layer).

This layer checks what can be checked without knowing the cluster: that every file exists and parses,
that each key is a known argument set exactly once (in any spelling, in any file), and that each value
has the right type. Rules between arguments and derived values come after, in ``finalize``.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from megatron.engine.optimizer_block import OPTIMIZER_KINDS, PARAMS_OF_KIND
from megatron.errors import ConfigError
from megatron.neox_arguments import arguments
from megatron.neox_arguments.arguments import schema_class
from megatron.neox_arguments.dialects import translate
from megatron.neox_arguments.keys import aliased_value, normalize_key, unknown_key_message
from megatron.neox_arguments.overrides import apply_overrides, command_line_wins, parse_overrides
from megatron.config_rules import DEFAULT
from megatron.neox_arguments.provenance import describe_source, field_default
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.neox_arguments.yaml_source import LocatedDict, load_yaml_file, plain, resolve_config_path
from megatron.plugins import load_user_plugins

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.dialects import Flag


def default_schema() -> type[NeoXArgs]:
    """The argument class, with the keys of every plug-in imported so far."""
    return schema_class()


@dataclass(frozen=True)
class ConfigFile:
    """One config file, read once: its path and its parsed mapping (None when empty or only comments)."""

    path: str
    data: LocatedDict | None


def read_config_files(paths: Sequence[str], conf_dir: str | None = None) -> tuple[list[ConfigFile], dict[str, str]]:
    """Read and parse each file once, in order -> ``(files, texts)`` (``texts``: every file's text by path, with
    the files they include)."""
    texts: dict[str, str] = {}
    files: list[ConfigFile] = []
    read: set[str] = set()
    for name in paths:
        path = resolve_config_path(name, conf_dir)
        if os.path.realpath(path) in read:
            raise ConfigError(f"config file {path} is given twice; list it once")
        read.add(os.path.realpath(path))
        data = load_yaml_file(path, texts)
        if data is not None and not isinstance(data, LocatedDict):
            raise ConfigError(
                f"{path}: a config file must be a mapping of 'key: value' lines, found a {type(data).__name__}"
            )
        files.append(ConfigFile(path, data))
    return files, texts


def load_plugins_named_in(files: Sequence[ConfigFile], overrides: Sequence[str]) -> list[str] | None:
    """Import the plug-ins a config names (``plugins:`` in a file or an override) before its keys are
    checked: their keys and registry names are part of the schema the rest is validated against.
    Returns them as every rank finds them (``.py`` files as absolute paths), None when none are named."""
    found: list[str] | None = None
    for item in files:
        data = item.data
        if data is not None and "plugins" in data:
            specs = plain(data["plugins"])
            if not isinstance(specs, list) or not all(isinstance(spec, str) for spec in specs):
                raise ConfigError(f"plugins at {data.where('plugins')} must be a list of module names or .py files")
            found = load_user_plugins(specs, where=data.where("plugins"),
                                      base_dir=os.path.dirname(os.path.abspath(item.path)))
    for override in parse_overrides(overrides):
        if override.path == ("plugins",) and isinstance(override.value, list):
            found = load_user_plugins(override.value, where="command line")
    return found


class _Keys:
    """Keys taken in order, with the checks every source of keys gets (a name, known, set once): each problem is
    collected, so a user fixes a config in one round instead of one key per launch."""

    def __init__(self, field_names: Iterable[str]) -> None:
        self.names = list(field_names)
        self.known = set(self.names)
        self.values: dict[str, Any] = {}
        self.provenance: dict[str, str] = {}
        self.spelled: dict[str, str] = {}  # argument -> key as written where it was first set
        self.problems: list[str] = []

    def take(self, raw_key: Any, value: Any, where: str) -> None:
        if not isinstance(raw_key, str):
            self.problems.append(f"key {raw_key!r} at {where} is not a name; argument names are text")
            return
        key = normalize_key(raw_key)
        if key in self.provenance:
            first = f"'{self.spelled[key]}' at {self.provenance[key]}"
            self.problems.append(f"key '{key}' is set twice: {first} and '{raw_key}' at {where}; keep one of them")
            return
        if key not in self.known:
            self.problems.append(unknown_key_message(raw_key, where, self.names))
            return
        self.values[key] = aliased_value(raw_key, plain(value))
        self.provenance[key] = where
        self.spelled[key] = raw_key

    def checked(self) -> tuple[dict[str, Any], dict[str, str]]:
        if self.problems:
            raise ConfigError(_join(self.problems))
        return self.values, self.provenance


def merge_config_files(files: Sequence[ConfigFile], field_names: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge the files' keys in order -> ``(values, provenance)``; every problem is raised as one error."""
    keys = _Keys(field_names)
    for item in files:
        for raw_key, value in (item.data or {}).items():
            keys.take(raw_key, value, item.data.where(raw_key) if item.data is not None else item.path)
    return keys.checked()


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)


def _type_name(annotation: Any) -> str:
    """Readable type: ``int | null``, ``'fp16' | 'bf16'``, ``list[int]``."""
    origin, members = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(repr(member) for member in members)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(member) for member in members)
    if origin is not None:
        inner = ", ".join(_type_name(member) for member in members)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", str(origin))
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def validation_message(
    err: ValidationError, schema: type[BaseModel], values: dict[str, Any], provenance: dict[str, str]
) -> str:
    """One line per bad argument: its value, the expected type, where it was set, pydantic's reason.

    Errors inside a dict-valued key (``optimizer.params.betas``) are named by their dotted path
    with the value found there; an unknown nested key gets the closest valid names.
    """
    lines: list[str] = []
    reported: set[str] = set()
    for item in err.errors():
        reason = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = item.get("loc") or ()
        if not loc:  # a check across fields: pydantic names no key, the reason must
            lines.append(reason)
            continue
        key = str(loc[0])
        inner_parts = [part for part in loc[1:] if not _is_type_tag(part)]
        shown_key = ".".join([key, *(str(p) for p in inner_parts)])
        if shown_key in reported:
            continue  # a union type yields one error per member; one line is enough
        reported.add(shown_key)
        field = schema.model_fields.get(key)
        # the most specific source: optimizer.params.lr=... on the command line, inside a block from a file
        dotted = [".".join([key, *map(str, inner_parts[:n])]) for n in range(len(inner_parts), 0, -1)]
        where = describe_source(next((provenance[p] for p in dotted if p in provenance), provenance.get(key, DEFAULT)))
        if item.get("type") == "missing" and not inner_parts:
            lines.append(f"missing key '{key}' ({_expected(field)}): set it in a config file or as {key}=...")
        elif not inner_parts:
            value = values.get(key, item.get("input"))
            lines.append(f"{key} = {value!r} at {where}: expected {_expected(field)}; {reason}")
        elif item.get("type") == "extra_forbidden":
            hint = _nested_suggestion(values.get(key), inner_parts)
            lines.append(f"{shown_key} at {where}: unknown key{hint}")
        elif item.get("type") == "missing" and isinstance(inner_parts[-1], int):
            # a too-short list for a fixed-length tuple (betas: [0.9])
            parent = ".".join([key, *(str(p) for p in inner_parts[:-1])])
            _, value = _value_at(values.get(key), inner_parts[:-1])
            lines.append(f"{parent} = {value!r} at {where}: needs more values (item {inner_parts[-1]} is missing)")
        elif item.get("type") == "missing":
            found, value = _value_at(values.get(key), inner_parts)
            lines.append(f"{shown_key} at {where}: missing in {value!r} ({reason})")
        else:
            found, value = _value_at(values.get(key), inner_parts)
            lines.append(f"{shown_key} = {value if found else item.get('input')!r} at {where}: {reason}")
    return _join(lines) if lines else str(err)


def _expected(field: Any) -> str:
    """The expected type in words; blocks with their own models are described by their keys."""
    if field is None:
        return "?"
    name = _type_name(field.annotation)
    return "a {type, params} block" if "Block" in name else name


def _value_at(value: Any, path: list[Any]) -> tuple[bool, Any]:
    """The raw value the user wrote at ``path`` inside a dict-valued key (for messages)."""
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            return False, value  # a missing element (betas: [0.9] lacks index 1): the enclosing value
    return True, value


_PARAMS_BY_MEANING = {"learning_rate": "lr", "beta1": "betas", "beta2": "betas", "adam_beta1": "betas",
                      "adam_beta2": "betas", "epsilon": "eps", "adam_epsilon": "eps"}
"""Names Hugging Face, Levanter and nanoGPT give the optimizer's parameters -> the block's own."""


def _nested_suggestion(value: Any, path: list[Any]) -> str:
    """``; did you mean lr?`` for a misspelt key inside the optimizer block."""
    allowed: list[str] = []
    if len(path) == 2 and path[0] == "params" and isinstance(value, dict):
        member = PARAMS_OF_KIND.get(OPTIMIZER_KINDS.get(str(value.get("type", "")).lower(), ""))
        allowed = list(member.model_fields) if member is not None else []
    elif len(path) == 1 and isinstance(value, dict):
        allowed = ["type", "params"]
    close = difflib.get_close_matches(str(path[-1]), allowed, n=2, cutoff=0.5)
    meant = _PARAMS_BY_MEANING.get(str(path[-1]))
    if meant in allowed:
        return f"; did you mean {meant}? ('{path[-1]}' is another trainer's name for it)"
    if close:
        return f"; did you mean {', '.join(close)}?"
    return f"; allowed here: {', '.join(allowed)}" if allowed else ""


def _is_type_tag(part: Any) -> bool:
    """pydantic puts the tried union member (``'int'``, ``"literal['all']"``, an optimizer kind)
    into ``loc``; hide it."""
    return isinstance(part, str) and (
        "[" in part or part in {"int", "float", "str", "bool", "dict", "list"} or part in set(OPTIMIZER_KINDS.values())
    )


def build_args(values: dict[str, Any], provenance: dict[str, str], schema: type[NeoXArgs]) -> NeoXArgs:
    try:
        args = schema.model_validate(values)
    except ValidationError as err:
        raise ConfigError(validation_message(err, schema, values, provenance)) from err
    _require_supported(args, values, provenance)
    return args


def _require_supported(args: BaseModel, values: dict[str, Any], provenance: dict[str, str]) -> None:
    """"not supported yet" for each key the user set to a value Deepy cannot honour, with its place.

    Which values are unsupported is the schema's knowledge (``arguments.require_supported``); only the
    keys the user set are checked, and the message gains where each was set.
    """
    user_set = {key: getattr(args, key) for key in values}
    offending = arguments.check_supported(user_set)
    if not offending:
        return
    try:
        arguments.require_supported(user_set)
    except ConfigError as err:
        places = ", ".join(f"{key} at {describe_source(provenance.get(key, DEFAULT))}" for key in offending)
        raise ConfigError(f"{err.message}\n  (set: {places})") from None


def load_config(
    paths: Sequence[str],
    overrides: Sequence[str] = (),
    conf_dir: str | None = None,
    dialect_flags: Sequence[Flag] = (),
) -> ResolvedConfig:
    """Read ``paths`` in order, apply ``key=value`` overrides last, validate types.

    A Levanter or fms-fsdp config (files or ``dialect_flags``) is translated to GPT-NeoX keys first
    (``megatron/neox_arguments/dialects``); from there on every dialect takes the same path.
    """
    translation = translate(paths, overrides, dialect_flags, conf_dir)
    if translation is not None:
        args = build_args(translation.values, translation.provenance, default_schema())
        args.config_files = dict(translation.texts)
        return ResolvedConfig(args=args, provenance=translation.provenance,
                              dialect=translation.record())
    if not paths:
        raise ConfigError("no config file given; pass at least one .yml file (e.g. configs/125M.yml)")
    files, texts = read_config_files(paths, conf_dir)
    plugin_specs = load_plugins_named_in(files, overrides)
    schema = default_schema()
    names = list(schema.model_fields)
    values, provenance = merge_config_files(files, names)
    apply_overrides(values, provenance, parse_overrides(overrides), names, lambda key: field_default(schema, key))
    replaced = command_line_wins(values, provenance)
    args = build_args(values, provenance, schema)
    if plugin_specs is not None:
        args.plugins = plugin_specs  # the ranks import the same files whatever their working directory
    if "config_files" in schema.model_fields and "config_files" not in values:
        # GPT-NeoX keeps the original file texts in the arguments (they end up in checkpoints)
        args.config_files = dict(texts)
    return ResolvedConfig(args=args, provenance=provenance, warnings=replaced)


def config_from_mapping(values: Mapping[str, Any], source: str = "<mapping>") -> ResolvedConfig:
    """A config given as a Python mapping (tools, tests, notebooks): the same structure checks as a
    file — unknown keys with suggestions, key spellings, types — with ``source`` as its provenance."""
    if isinstance(values.get("plugins"), list):  # other values: the type check below reports them
        load_user_plugins(values["plugins"], where=source)
    schema = default_schema()
    keys = _Keys(schema.model_fields)
    for raw_key, value in values.items():
        keys.take(raw_key, value, source)
    normalized, _ = keys.checked()
    provenance = {key: source for key in normalized}
    return ResolvedConfig(args=build_args(normalized, provenance, schema), provenance=provenance)
