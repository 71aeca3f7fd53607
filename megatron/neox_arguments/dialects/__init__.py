"""Configs and flags in Levanter's and fms-fsdp's dialects, translated to GPT-NeoX keys at one point.

``deepy.py`` takes three dialects:

* GPT-NeoX (Deepy's own): flat YAML files and ``key=value`` overrides;
* Levanter: nested ``data/model/trainer/optimizer`` YAML (``!include`` per section),
  ``--config_path F`` and draccus flags ``--a.b value`` / ``--a.b=value``;
* fms-fsdp: flat ``train_config`` keys as ``--key=value`` flags or in a YAML file.

:func:`translate` finds which one a command speaks and, for Levanter or fms-fsdp, returns GPT-NeoX
values with provenance (``file:line (levanter trainer.num_train_steps)``) and one row per dialect
key for ``--dry-run``; everything after it is the GPT-NeoX path. One run speaks one dialect: the
launch keys (``num_gpus``, ``num_nodes``, ``hostfile``, ``launcher``, ``master_port``) may accompany
any of them.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron.errors import ConfigError, UsageError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.dialects import fms, levanter
from megatron.neox_arguments.dialects.common import LAUNCH_KEYS, Leaf, Refused, Translation, flatten, translate_leaves
from megatron.neox_arguments.overrides import parse_overrides
from megatron.neox_arguments.yaml_source import LocatedDict, load_yaml_file, parse_yaml_text, resolve_config_path

GPT_NEOX = "gpt-neox"
DEEPY_FLAGS = frozenset({"--dry-run", "--debug", "--verbose", "--help"})
DEEPY_VALUE_FLAGS = frozenset({"-d", "--conf_dir", "--conf-dir", "--rehearse"})


def _neox_fields() -> set[str]:
    return set(NeoXArgs.model_fields)


def fms_only_keys() -> set[str]:
    """fms-fsdp keys that are not also GPT-NeoX keys: seeing one means the config is fms-fsdp's."""
    return (set(fms.RULES) | set(fms.REFUSED)) - _neox_fields()


# ------------------------------------------------------------------------------------ argv split


@dataclass(frozen=True)
class Flag:
    """One ``--key value`` / ``--key=value`` flag of a dialect, as written."""

    key: str
    text: str
    value_text: str | None
    """None: a bare ``--flag`` (true)."""

    @property
    def where(self) -> str:
        return self.text


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[Flag]]:
    """Take the dialect flags (``--config_path F``, ``--a.b v``, ``--key=value``) out of deepy.py's argv.

    Deepy's own flags (``--dry-run``, ``--debug``, ``-d DIR``) stay; any other ``--name`` is a dialect
    flag whose value is after ``=`` or the next token (a bare flag followed by another flag is true,
    as fms-fsdp's command line reads it).
    """
    rest: list[str] = []
    flags: list[Flag] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token.partition("=")[0]
        if name in DEEPY_FLAGS or name in DEEPY_VALUE_FLAGS or not token.startswith("--") or token == "--":
            rest.append(token)
            if token in DEEPY_VALUE_FLAGS and i + 1 < len(tokens):
                rest.append(tokens[i + 1])
                i += 1
            i += 1
            continue
        key = name[2:]
        if "=" in token:
            flags.append(Flag(key, token, token.partition("=")[2]))
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags.append(Flag(key, f"{token} {tokens[i + 1]}", tokens[i + 1]))
            i += 1
        else:
            flags.append(Flag(key, token, None))
        i += 1
    return rest, flags


def _flag_value(flag: Flag) -> Any:
    if flag.value_text is None:
        return True
    return parse_yaml_text(flag.value_text, f"flag '{flag.text}'")


# ---------------------------------------------------------------------------------- detection


@dataclass
class _File:
    path: str
    data: Any
    dialect: str
    """levanter | fms-fsdp | gpt-neox | neutral (only launch keys)."""


def classify(data: Any) -> str:
    """Which dialect a parsed config file is written in."""
    if not isinstance(data, dict):
        return GPT_NEOX
    keys = set(data)
    sections = [k for k in levanter.SECTIONS if isinstance(data.get(k), dict)]
    if any(k in sections for k in ("data", "model", "trainer")):
        return levanter.NAME
    if "optimizer" in sections and "params" not in data["optimizer"] and "type" not in data["optimizer"]:
        return levanter.NAME
    if keys & (levanter.TOP_KEYS - _neox_fields()):  # TrainLmConfig's own keys (z_loss_weight, eval_harness, ...)
        return levanter.NAME
    if keys & fms_only_keys():
        return fms.NAME
    if keys and keys <= LAUNCH_KEYS:
        return "neutral"
    return GPT_NEOX


def _flag_dialect(flag: Flag) -> str:
    key = flag.key.replace("-", "_") if flag.key != "config_path" else flag.key
    if key == "config_path" or key.split(".")[0] in levanter.SECTIONS and "." in key:
        return levanter.NAME
    if key.split(".")[0] in levanter.TOP_KEYS:  # TrainLmConfig's own keys (z_loss_weight, eval_harness, ...)
        return levanter.NAME
    if key in LAUNCH_KEYS:
        return "neutral"
    if key in fms.RULES or key in fms.REFUSED:
        return fms.NAME
    return "unknown"


def _unknown_flag(flag: Flag) -> str:
    choices = ["config_path", *levanter.RULES, *fms.RULES, *LAUNCH_KEYS]
    close = difflib.get_close_matches(flag.key, choices, n=3, cutoff=0.6)
    hint = f"; did you mean: {', '.join('--' + c for c in close)}?" if close else ""
    return (f"unknown flag '{flag.text}'{hint} (GPT-NeoX keys are overridden as key=value after the config "
            f"files; Levanter's flags are --section.key value, fms-fsdp's --key=value)")


def _mixing_error(seen: dict[str, str]) -> ConfigError:
    said = "; ".join(f"{dialect} ({where})" for dialect, where in seen.items())
    return ConfigError(
        f"this command mixes config dialects: {said}. Write one run in one dialect; only the launch keys "
        f"({', '.join(sorted(LAUNCH_KEYS))}) may accompany any of them"
    )


# -------------------------------------------------------------------------------- translation


def translate(
    paths: Sequence[str], overrides: Sequence[str], flags: Sequence[Flag], conf_dir: str | None = None
) -> Translation | None:
    """The Levanter or fms-fsdp config of this command as GPT-NeoX values, or None for GPT-NeoX's own."""
    config_paths = list(paths)
    other_flags: list[Flag] = []
    for flag in flags:
        if flag.key == "config_path":
            if flag.value_text is None:
                raise UsageError("--config_path needs a file name")
            config_paths.append(flag.value_text)
        else:
            other_flags.append(flag)
    texts: dict[str, str] = {}
    files: list[_File] = []
    for name in config_paths:
        path = resolve_config_path(name, conf_dir)
        data = load_yaml_file(path, texts)
        files.append(_File(path, data, classify(data)))
    seen: dict[str, str] = {}
    for item in files:
        if item.dialect != "neutral":
            seen.setdefault(item.dialect, item.path)
    for flag in other_flags:
        kind = _flag_dialect(flag)
        if kind == "unknown":
            raise UsageError(_unknown_flag(flag))
        if kind != "neutral":
            seen.setdefault(kind, flag.text)
    neutral_overrides = []
    for override in parse_overrides(overrides):
        if override.path[0] in LAUNCH_KEYS:
            neutral_overrides.append(override)
        else:
            seen.setdefault(GPT_NEOX, override.text)
    dialects = [d for d in seen if d != GPT_NEOX]
    if not dialects:
        if any(_flag_dialect(f) == "neutral" for f in other_flags):
            raise UsageError(f"flags such as '{other_flags[0].text}' go with a Levanter or fms-fsdp config; "
                             f"GPT-NeoX overrides are written key=value")
        return None
    if len(seen) > 1:
        raise _mixing_error(seen)
    dialect = dialects[0]
    module = levanter if dialect == levanter.NAME else fms
    translation = Translation(dialect=dialect, texts=texts)
    leaves: dict[str, Leaf] = {}
    neutral: list[Leaf] = []
    for item in files:
        if item.data is None:
            continue
        file_leaves: dict[str, Leaf] = {}
        data = item.data
        if item.dialect == "neutral":
            for key, value in data.items():
                neutral.append(Leaf(key, value, data.where(key) if isinstance(data, LocatedDict) else item.path))
            continue
        flatten(data, "", item.path, file_leaves, keep_whole=module.KEEP_WHOLE)
        for path, leaf in file_leaves.items():
            if path in leaves:
                raise ConfigError(f"{dialect} key {path} is set at {leaves[path].where} and again at {leaf.where}; keep one")
            leaves[path] = leaf
    for flag in other_flags:  # flags come last and win, as draccus and fms-fsdp's command line do
        key = flag.key if dialect == levanter.NAME else flag.key.replace("-", "_")
        if _flag_dialect(flag) == "neutral":
            neutral.append(Leaf(key, _flag_value(flag), flag.where))
            continue
        value = _flag_value(flag)
        if isinstance(value, dict):
            flatten(value, key, flag.where, leaves, keep_whole=module.KEEP_WHOLE)
        else:
            for shadowed in [p for p in leaves if p.startswith(key + ".")]:
                del leaves[shadowed]  # a flag giving a whole section replaces that section
            leaves[key] = Leaf(key, value, flag.where)
    translate_leaves(dialect, leaves, module.RULES, module.REFUSED, translation, module.KEEP_WHOLE)
    try:
        module.implied(translation, leaves, config_paths[0] if config_paths else "the command line")
    except Refused as err:  # a default the dialect implies, refused with what the config does say
        raise ConfigError(f"{dialect}: {err}") from None
    for leaf in neutral:
        translation.put(leaf, {leaf.path: leaf.value})
    for override in neutral_overrides:
        translation.put(Leaf(override.dotted, override.value, override.text), {override.path[0]: override.value})
    return translation


__all__ = ["Flag", "Translation", "classify", "split_argv", "translate"]
