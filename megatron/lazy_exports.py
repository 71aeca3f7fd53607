"""Package attributes loaded on first use (PEP 562), for packages whose submodules pull heavy imports.

A package lists the names it exports in ``_EXPORTS`` (name -> submodule, relative to the package or a
full ``megatron.`` module name) and sets ``__getattr__ = lazy_exports(__name__, _EXPORTS)``. Importing the
package then imports none of them: ``from megatron.mpu import get_topology`` loads ``mpu.topology`` (and
DeepSpeed) only when the name is asked for, so the launcher and the schema stay light.
``tests/unit/test_import_graph.py`` reads ``_EXPORTS`` to draw these edges.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` serving ``exports``. Nothing is cached on the package,
    so a name always reads the submodule's current value (tests may patch it there)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = module if module.startswith("megatron.") else f"{package}.{module}"
        return getattr(importlib.import_module(target), name)

    return __getattr__
