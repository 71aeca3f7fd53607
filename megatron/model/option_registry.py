"""A registry of one kind of architectural option: config string -> entry.

Each kind (norm, activation, positional embedding, attention type, MLP type, layer family) keeps its
registry beside the modules it builds (``norms.py``, ``activations.py``, ``transformer_options.py``,
``family_config.py``). An entry builds its module and states what it adds to the parameter count and
to the FLOPs per token; ``flops.py`` (parameter count, MFU) and ``engine/memory.py`` read the entries,
so the counts cannot disagree with each other or with the module (``tests/unit/test_option_registries.py``
builds every entry and compares).

Registries and their entries import no torch: the launcher checks configs and ``--dry-run`` counts
parameters without it. An entry that builds a torch module of Deepy's own gets its class from the module that
builds it (``attach``: ``blocks.py``, ``pipeline.py``, ``embedding.py``), never by naming it: a registry knows
names and counts, the builder knows the classes.

A user adds an option with one plug-in file (named by the ``plugins`` key, ``megatron/plugins.py``)
that calls the kind's ``register``; docs/architecture.md, "Adding an architectural option".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

E = TypeVar("E")


class OptionRegistry(Generic[E]):
    """Named entries of one option kind, in registration order; the config key's accepted values."""

    def __init__(self, key: str) -> None:
        self.key = key
        """The config key whose value selects an entry (``norm``, ``activation``, ...)."""
        self._entries: dict[str, E] = {}
        self._owners: dict[str, str] = {}

    def register(self, name: str, entry: E, owner: str = "") -> E:
        """Add ``entry`` as ``name``. A name registered by another module is an error (which one would
        win is not obvious); the same module registering again (a re-import) replaces its entry."""
        if name in self._owners and self._owners[name] != owner:
            raise ValueError(f"{self.key} {name!r} is registered twice: by {self._owners[name]} and by {owner}")
        self._entries[name], self._owners[name] = entry, owner
        return entry

    def attach(self, name: str, **implementation: Any) -> None:
        """Fill in entry ``name``'s fields that hold torch classes (left None by the registry, which imports
        no torch), from the module that builds them."""
        self._entries[name] = dataclasses.replace(self[name], **implementation)  # type: ignore[type-var]

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> list[tuple[str, E]]:
        return list(self._entries.items())

    def __getitem__(self, name: str) -> E:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.key} {name!r}; choose one of {', '.join(self._entries)}") from None

    def validate(self, value: str) -> str:
        """For a pydantic validator of the selecting key: ``value`` must be a registered name."""
        if value not in self._entries:
            raise ValueError(f"{value!r} is not a registered {self.key}; one of {', '.join(self._entries)} (or a "
                             f"plug-in's, named by the plugins key)")
        return value
