"""Plug-ins: LR schedules, trackers, objectives and tokenizers as registry entries that carry their
own config keys, checks and needs.

A plug-in is registered by the module that implements it, with everything the rest of the system must
know about it, so that adding one is one file (plus its test):

* ``keys`` — an :class:`~megatron.config_schema.ArgGroup` of the flat config keys it reads; they join
  the one argument object (``NeoXArgs``), the docs and ``--dry-run`` like every other key;
* ``block`` — for trackers, the pydantic model of its entry in the ``tracker:`` list;
* ``check`` — ``(args, show) -> list[str]``: problems with a validated config that selects it,
  reported before launch with every other problem (``show(key)`` renders ``key=value (file:line)``);
* ``needs`` — what it requires from the rest of the run (an objective: its dataset kind, a value head,
  a reference model; a tokenizer: the files it reads, an optional package).

The accepted values of the selecting keys (``lr_decay_style``, ``train_impl``, ``tokenizer_type``,
``tracker[].type``) are the registry's names (``optimizer.type``'s are the optimizer builders',
``megatron/engine/optimizer_block.py``). Deepy's own plug-ins register when their family's module
is imported (:data:`BUILTIN_MODULES`); a user's are named by the ``plugins`` config key (module names or
``.py`` paths) and imported before the config is validated, on the launcher and on every rank.

This module sits below everything else but the check registry (``megatron/config_rules.py``): it
imports no component and no argument code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError

Family = Literal["lr_decay_style", "tracker", "train_impl", "tokenizer_type"]

BUILTIN_MODULES: dict[str, tuple[str, ...]] = {
    # GPT-NeoX's schedules, then Levanter's and fms-fsdp's (their dialects' curves)
    "lr_decay_style": ("megatron.engine.lr_schedules", "megatron.engine.lr_dialects"),
    "tracker": ("megatron.logging.trackers",),
    "train_impl": ("megatron.objectives.registry",),
    "tokenizer_type": ("megatron.tokenizer.registry",),
}
"""Family -> the modules whose import registers Deepy's own plug-ins of that family."""

Check = Callable[[Any, Callable[[str], str]], list[str]]


@dataclass(frozen=True)
class Plugin:
    family: str
    name: str
    target: Any
    """What the family's component builds from: a decay shape, a tracker factory, an objective or a
    tokenizer class; or ``"module:attribute"`` naming it, imported on first use (Deepy's objectives and
    tokenizers are declared that way so that ``deepy.py`` validates a config without DeepSpeed or the
    tokenizer libraries)."""
    keys: type[ArgGroup] | None = None
    block: type[BaseModel] | None = None
    check: Check | None = None
    needs: Mapping[str, Any] = field(default_factory=dict)
    module: str = ""

    def resolve(self) -> Any:
        """The target itself (importing it when it was declared by name)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


_REGISTRY: dict[str, dict[str, Plugin]] = {family: {} for family in BUILTIN_MODULES}
_LOADED_BUILTINS: set[str] = set()

T = TypeVar("T")


def register(
    family: Family,
    name: str,
    *,
    keys: type[ArgGroup] | None = None,
    block: type[BaseModel] | None = None,
    check: Check | None = None,
    **needs: Any,
) -> Callable[[T], T]:
    """Decorator: register the decorated object as plug-in ``name`` of ``family``.

    Registering a name twice from different modules is an error (which one would win is not
    obvious); re-importing the same module (tests, reloads) replaces its own entry.
    """
    if family not in _REGISTRY:
        raise ValueError(f"unknown plug-in family {family!r}; one of {', '.join(_REGISTRY)}")

    def add(target: T) -> T:
        module = getattr(target, "__module__", "") or ""
        existing = _REGISTRY[family].get(name)
        if existing is not None and existing.module != module:
            raise ConfigError(f"{family} plug-in {name!r} is registered twice: by {existing.module} and by {module}")
        _REGISTRY[family][name] = Plugin(family, name, target, keys, block, check, dict(needs), module)
        return target

    return add


def declare(
    family: Family,
    name: str,
    target: str,
    *,
    keys: type[ArgGroup] | None = None,
    block: type[BaseModel] | None = None,
    check: Check | None = None,
    **needs: Any,
) -> Plugin:
    """Register a plug-in whose implementation is imported on first use (``target`` =
    ``"module:attribute"``); the declaring module must stay light."""
    caller = target.partition(":")[0]
    plugin = Plugin(family, name, target, keys, block, check, dict(needs), caller)
    existing = _REGISTRY[family].get(name)
    if existing is not None and existing.module != caller:
        raise ConfigError(f"{family} plug-in {name!r} is registered twice: by {existing.module} and by {caller}")
    _REGISTRY[family][name] = plugin
    return plugin


def validate_name(family: Family, value: Any, not_built: Iterable[str] = ()) -> Any:
    """For a pydantic validator of a selecting key: ``value`` must name a registered plug-in (or one
    of GPT-NeoX's values Deepy has not built, which the "not supported yet" check then refuses)."""
    known = names(family)
    if value in known or value in tuple(not_built):
        return value
    raise ValueError(f"{value!r} is not one of the registered {family} values: {', '.join(known)}")


def load_builtins(families: Iterable[str] | None = None) -> None:
    """Import the modules that register Deepy's own plug-ins (once)."""
    for family in families if families is not None else BUILTIN_MODULES:
        if family not in _LOADED_BUILTINS:
            for module in BUILTIN_MODULES[family]:
                importlib.import_module(module)
            _LOADED_BUILTINS.add(family)


def names(family: Family) -> tuple[str, ...]:
    """The accepted values of the family's selecting key, in registration order."""
    load_builtins([family])
    return tuple(_REGISTRY[family])


def get(family: Family, name: str) -> Plugin:
    load_builtins([family])
    try:
        return _REGISTRY[family][name]
    except KeyError:
        raise ConfigError(f"{family}: {name!r} is not registered; known: {', '.join(_REGISTRY[family])}") from None


def find(family: Family, name: str) -> Plugin | None:
    load_builtins([family])
    return _REGISTRY[family].get(name)


def of_family(family: Family) -> list[Plugin]:
    load_builtins([family])
    return list(_REGISTRY[family].values())


def all_plugins() -> list[Plugin]:
    load_builtins()
    return [plugin for family in _REGISTRY.values() for plugin in family.values()]


def key_groups() -> list[tuple[str, type[ArgGroup]]]:
    """``(group name, keys)`` of every registered plug-in that declares keys, e.g.
    ``("train_impl:dpo", DPOKeys)``."""
    return [(f"{p.family}:{p.name}", p.keys) for p in all_plugins() if p.keys is not None]


# ---- before launch ------------------------------------------------------------------------------

PLUGIN_SELECTORS: tuple[Family, ...] = ("lr_decay_style", "train_impl", "tokenizer_type")
"""Flat keys that select a plug-in (tracker plug-ins are selected by their ``tracker:`` entry)."""


@rule
def plugin_keys_match_selection(ctx: RuleContext) -> list[str]:
    """A plug-in's keys set while another plug-in of its family is selected would be silently
    ignored: refuse them. The selected plug-in's own checks run here too."""
    problems: list[str] = []
    for family in PLUGIN_SELECTORS:
        selected = str(ctx.get(family))
        for plugin in of_family(family):
            given = [key for key in (plugin.keys.model_fields if plugin.keys else ()) if ctx.given(key)]
            if given and plugin.name != selected:
                problems.append(f"{', '.join(ctx.show(k) for k in given)} only apply to {family}: {plugin.name} "
                                f"({ctx.show(family)}): remove them or set {family}: {plugin.name}")
        chosen = find(family, selected)
        if chosen is not None and chosen.check is not None:
            problems.extend(chosen.check(ctx.args, ctx.show))
    return problems


# ---- the user's plug-ins ------------------------------------------------------------------------

_USER_MODULES: dict[str, ModuleType] = {}


def load_user_plugins(specs: Iterable[str], where: str = "plugins", base_dir: str | None = None) -> list[str]:
    """Import each plug-in named by the ``plugins`` key: a module name (importable from the Python
    path) or a ``.py`` file, relative to ``base_dir`` (the directory of the config file naming it).
    Returns the specs as the ranks must see them (files made absolute)."""
    load_builtins()
    resolved: list[str] = []
    for spec in specs:
        if not isinstance(spec, str) or not spec:
            raise ConfigError(f"plugins ({where}): {spec!r} is not a module name or a .py file")
        if spec.endswith(".py"):
            path = os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(spec)))
            if not os.path.isfile(path):
                raise ConfigError(f"plugins: {spec!r} ({where}) is not a file")
            _import_file(path, where)
            resolved.append(path)
        else:
            try:
                _USER_MODULES[spec] = importlib.import_module(spec)
            except ImportError as err:
                raise ConfigError(f"plugins: cannot import {spec!r} ({where}): {err}") from err
            resolved.append(spec)
    return resolved


def _import_file(path: str, where: str) -> None:
    if path in _USER_MODULES:
        return
    name = "deepy_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plugins: cannot load {path} ({where})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the plug-in's annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as err:  # a user's file: any failure is a config problem, not a crash
        sys.modules.pop(name, None)
        raise ConfigError(f"plugins: {path} ({where}) failed to import: {type(err).__name__}: {err}") from err
    _USER_MODULES[path] = module


class PluginArgs(ArgGroup):
    """Keys of the plug-in mechanism itself."""

    plugins: list[str] = []
    """Deepy addition: plug-in modules to import before the config is validated — module names on
    the Python path or ``.py`` files — each registering LR schedules, trackers, objectives or
    tokenizers with their own keys (see ``megatron/plugins.py``)."""
