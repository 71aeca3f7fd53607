"""Every third-party module the project imports is declared in requirements/ (or setup.py).

CI runs on a machine where whatever was installed by hand stays installed, and a user's clone runs on
a machine where nothing is: an import that no requirements file names passes here and fails there.
This test reads every ``.py`` file of the repository (imports at any depth, the lazy ones inside
functions too), keeps the top-level names that are neither the standard library nor our own modules,
and asks which installed distribution provides each (``importlib.metadata``). A name counts as
declared when that distribution, or the name itself, is listed in ``requirements/*.txt``.

A module that is only installed as a dependency of a declared package (``requests`` through ``wandb``)
is *not* declared: the day that package drops it, our import breaks.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".eggs", "node_modules"}


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(root: Path) -> set[str]:
    names: set[str] = set()
    for path in sorted((root / "requirements").glob("*.txt")):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
            if match and not line.startswith("-"):
                names.add(normalize(match.group(0)))
    return names


def python_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if not SKIP_DIRS & set(p.relative_to(root).parts)]


def local_modules(root: Path) -> set[str]:
    """Top-level names that resolve inside the repository: its packages and scripts, and the modules
    that tests and tools import from their own folder (``from launch_helpers import ...``)."""
    return {p.stem for p in python_files(root)} | {p.name for p in root.iterdir() if p.is_dir()}


def imported_modules(path: Path) -> dict[str, int]:
    """Top-level module -> first line that imports it (absolute imports only)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


NOT_INSTALLABLE_HERE = {"fla": ["flash-linear-attention"]}
"""Providers of modules whose distributions cannot be installed on a CPU machine (CUDA builds), so
``importlib.metadata`` cannot name them: requirements/requirements-kernels.txt."""


def undeclared_imports(root: Path) -> list[str]:
    """``module (file:line)`` for each third-party import no requirements file declares."""
    declared = declared_distributions(root)
    local = local_modules(root)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    providers = {**NOT_INSTALLABLE_HERE, **metadata.packages_distributions()}
    missing = []
    for path in python_files(root):
        for module, line in imported_modules(path).items():
            if module in stdlib or module in local or (path.name == "setup.py" and module == "setuptools"):
                continue
            dists = {normalize(d) for d in providers.get(module, [])}
            if normalize(module) in declared or dists & declared:
                continue
            missing.append(f"{module} ({path.relative_to(root)}:{line})")
    return missing


def test_every_third_party_import_is_declared() -> None:
    missing = undeclared_imports(REPO)
    assert not missing, "imported but declared in no requirements/*.txt: " + ", ".join(missing)


def test_an_undeclared_import_is_found(tmp_path: Path) -> None:
    """The check can fail: our requirements without ``pytorch_optimizer`` and a module importing it
    (installed here or not) and ``requests`` (installed only as a dependency of wandb) report both,
    lazy imports inside functions included, and stop reporting once they are declared."""
    (tmp_path / "requirements").mkdir()
    for req in (REPO / "requirements").glob("*.txt"):
        lines = [line for line in req.read_text().splitlines() if not line.startswith("pytorch_optimizer")]
        (tmp_path / "requirements" / req.name).write_text("\n".join(lines) + "\n")
    pkg = tmp_path / "megatron"
    pkg.mkdir()
    (pkg / "feature.py").write_text(
        "import os\nimport numpy\nfrom megatron import feature\n\n"
        "def build():\n    from pytorch_optimizer import Lion\n    import requests.adapters\n"
    )
    assert sorted(undeclared_imports(tmp_path)) == [
        "pytorch_optimizer (megatron/feature.py:6)",
        "requests (megatron/feature.py:7)",
    ]
    extra = tmp_path / "requirements" / "requirements-extra.txt"
    extra.write_text("pytorch-optimizer==4.1.0\nrequests>=2  # direct use\n")
    assert undeclared_imports(tmp_path) == []
