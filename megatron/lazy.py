"""Names a package exports on first use (PEP 562), so that importing the package stays cheap.

A package whose public names live in heavy modules (torch, DeepSpeed) while a light part of it is read
before launch (its keys, by the argument schema and ``deepy.py --dry-run``) lists them in an ``_EXPORTS``
dict and takes its module ``__getattr__`` from here::

    _EXPORTS = {"GPTModel": "gpt", "NeoXArgs": "megatron.neox_arguments.arguments"}
    __getattr__ = lazy_exports(__name__, _EXPORTS)

A value is a module of the package (``"gpt"``) or a full dotted name (``"megatron.x.y"``). The dict stays a
literal: ``tests/unit/test_import_graph.py`` reads it to count ``from package import Name`` as an import
of the module that defines ``Name``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def export_module(package: str, where: str) -> str:
    """The dotted module an ``_EXPORTS`` value names: ``where`` itself when it is a full name (it starts with
    the package's top-level name), else a module of ``package``."""
    return where if where.startswith(package.split(".")[0] + ".") else f"{package}.{where}"


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``name`` is imported from the module ``exports[name]``
    names when it is read (each time: a name patched in its module is seen through the package too);
    any other name is an ``AttributeError``, as for a module without it."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(export_module(package, where)), name)

    return __getattr__
