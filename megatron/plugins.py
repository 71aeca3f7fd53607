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
``megatron/engine/optimizer_block.py``). A user's plug-ins are named by the ``plugins`` config key (module
names or ``.py`` paths) and imported before the config is validated, on the launcher and on every rank;
each calls :func:`register` with its implementation.

Deepy's own entries are split by layer, because their readers sit at several heights: a table of names and
needs is declared (:func:`declare`) by a module at or below the lowest layer that reads it, and the layer
that owns the implementation attaches it (:func:`attach`: the implementation, the keys and the check) when
its module is imported. This module knows no module of theirs; each family's table says when it is complete
(:func:`builtins_declared`), and reading a family before that is an error, not an empty list:

* ``train_impl``: names and needs in ``megatron/objective_needs.py`` (the data and checkpoint layers read
  them); keys, checks and the objectives in ``megatron/objectives/registry.py``;
* ``tokenizer_type``: names and needs in ``megatron/tokenizer/registry.py``; the classes, imported by name on
  first use (their libraries are optional), in ``megatron/tokenizer/build.py``;
* ``tracker``: names and ``tracker:`` blocks in ``megatron/logging/config.py``; the trackers in
  ``megatron/logging/trackers.py``;
* ``lr_decay_style``: registered whole by ``megatron/engine/lr_schedules.py`` and ``lr_dialects.py`` (only
  the engine and the argument layer read it).

This module sits below everything else but the check registry (``megatron/config_rules.py``): it
imports no component and no argument code.
"""

from __future__ import annotations

import dataclasses
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
FAMILIES: tuple[Family, ...] = ("lr_decay_style", "tracker", "train_impl", "tokenizer_type")

Check = Callable[[Any, Callable[[str], str]], list[str]]


@dataclass(frozen=True)
class Plugin:
    family: str
    name: str
    target: Any = None
    """What the family's component builds from: a decay shape, a tracker factory, an objective or a
    tokenizer class; or ``"module:attribute"`` naming it, imported on first use (Deepy's tokenizers, whose
    libraries are optional); None until the layer that implements a declared entry attaches it."""
    keys: type[ArgGroup] | None = None
    block: type[BaseModel] | None = None
    check: Check | None = None
    needs: Mapping[str, Any] = field(default_factory=dict)
    module: str = ""
    """The module that registered or declared the entry."""

    def resolve(self) -> Any:
        """The target itself (importing it when it was declared by name)."""
        if self.target is None:
            raise LookupError(f"{self.family} {self.name!r} is declared by {self.module} but nothing attached its "
                              "implementation: import the module of the layer that implements it")
        if not isinstance(self.target, str):
            return self.target
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


_REGISTRY: dict[str, dict[str, Plugin]] = {family: {} for family in FAMILIES}
_DECLARED: set[str] = set()
"""Families whose table of Deepy's own entries is complete (:func:`builtins_declared`)."""

T = TypeVar("T")


def _add(plugin: Plugin) -> Plugin:
    """Store ``plugin``; a name registered by another module is an error (which one would win is not
    obvious), the same module registering again (a re-import: tests, reloads) replaces its own entry."""
    if plugin.family not in _REGISTRY:
        raise ValueError(f"unknown plug-in family {plugin.family!r}; one of {', '.join(_REGISTRY)}")
    existing = _REGISTRY[plugin.family].get(plugin.name)
    if existing is not None and existing.module != plugin.module:
        raise ConfigError(f"{plugin.family} plug-in {plugin.name!r} is registered twice: by {existing.module} and "
                          f"by {plugin.module}")
    _REGISTRY[plugin.family][plugin.name] = plugin
    return plugin


def register(
    family: Family,
    name: str,
    *,
    keys: type[ArgGroup] | None = None,
    block: type[BaseModel] | None = None,
    check: Check | None = None,
    **needs: Any,
) -> Callable[[T], T]:
    """Decorator: register the decorated object as plug-in ``name`` of ``family``, whole (its
    implementation with its keys, checks and needs): how a user's plug-in registers."""

    def add(target: T) -> T:
        module = getattr(target, "__module__", "") or ""
        _add(Plugin(family, name, target, keys, block, check, dict(needs), module))
        return target

    return add


def declare(
    family: Family,
    name: str,
    *,
    module: str,
    block: type[BaseModel] | None = None,
    **needs: Any,
) -> Plugin:
    """Declare Deepy's own entry ``name`` of ``family`` with what the layers below its implementation read
    (its needs; a tracker's block), from ``module``, a module at or below them; the layer that implements it
    calls :func:`attach`."""
    existing = _REGISTRY.get(family, {}).get(name)
    kept = {} if existing is None or existing.module != module else {
        "target": existing.target, "keys": existing.keys, "check": existing.check}  # a re-import keeps what was attached
    return _add(Plugin(family, name, block=block, needs=dict(needs), module=module, **kept))


def attach(family: Family, name: str, *, target: Any = None, keys: type[ArgGroup] | None = None,
           check: Check | None = None) -> None:
    """Attach to the declared entry ``name`` what its implementing layer holds: the implementation
    (``target``, an object or ``"module:attribute"``), its keys and its check."""
    entry = _REGISTRY[family].get(name)
    if entry is None:
        raise ValueError(f"{family} {name!r} is attached but never declared (declare its name and needs first)")
    given = {"target": target, "keys": keys, "check": check}
    _REGISTRY[family][name] = dataclasses.replace(entry, **{k: v for k, v in given.items() if v is not None})


def builtins_declared(family: Family) -> None:
    """Called by the module that declares the last of Deepy's own entries of ``family``: from now on the
    family can be read."""
    _DECLARED.add(family)


def _entries(family: Family) -> dict[str, Plugin]:
    if family not in _DECLARED:
        raise LookupError(f"the {family} plug-ins are read before Deepy's own are declared: import the module "
                          f"that declares them first (see megatron/plugins.py)")
    return _REGISTRY[family]


def require_tables(families: Iterable[Family] = FAMILIES) -> None:
    """Every family's table of Deepy's own entries is loaded (the caller imported the modules that declare
    them), else a ``LookupError`` naming the first that is not."""
    for family in families:
        _entries(family)


def validate_name(family: Family, value: Any, not_built: Iterable[str] = ()) -> Any:
    """For a pydantic validator of a selecting key: ``value`` must name a registered plug-in (or one
    of GPT-NeoX's values Deepy has not built, which the "not supported yet" check then refuses)."""
    known = names(family)
    if value in known or value in tuple(not_built):
        return value
    raise ValueError(f"{value!r} is not one of the registered {family} values: {', '.join(known)}")


def names(family: Family) -> tuple[str, ...]:
    """The accepted values of the family's selecting key, in registration order."""
    return tuple(_entries(family))


def get(family: Family, name: str) -> Plugin:
    entries = _entries(family)
    try:
        return entries[name]
    except KeyError:
        raise ConfigError(f"{family}: {name!r} is not registered; known: {', '.join(entries)}") from None


def find(family: Family, name: str) -> Plugin | None:
    return _entries(family).get(name)


def of_family(family: Family) -> list[Plugin]:
    return list(_entries(family).values())


def all_plugins() -> list[Plugin]:
    return [plugin for family in FAMILIES for plugin in of_family(family)]


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
