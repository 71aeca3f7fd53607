"""No private DeepSpeed or torch name is touched outside the two internals modules.

``megatron/deepspeed_internals.py`` and ``megatron/torch_internals.py`` are the only places Deepy may
reach past DeepSpeed's or torch's public API; ``test_deepspeed_internals.py`` and
``test_torch_internals.py`` pin every such touch, so an upgrade that moves one fails there, in one
place. This test reads the source (AST, nothing imported) of ``megatron/``, ``tools/`` and the entry
scripts (``deepy.py``, ``train.py``, ``generate.py``, ``eval.py``, ``prepare_data.py``) and reports each
touch made anywhere else.

What counts as a touch (a *private* name starts with ``_`` and is not a dunder such as
``__version__``):

1. importing a private module or name from ``torch``/``deepspeed``: ``import torch._dynamo``,
   ``from torch._utils import x``, ``from deepspeed.x import _y``;
2. a private attribute anywhere on a chain rooted at a name imported from ``torch``/``deepspeed``:
   ``torch._C``, ``torch.cuda.memory._dump_snapshot``, ``nn.Module._apply`` (after ``from torch import nn``);
3. a private attribute of an *object* (``engine._config``, ``tensor._version``, ``layer._modules``,
   ``getattr(p, "_hp_mapping")``), unless the name is one our own code defines (a method or class
   attribute of one of our classes, ``self._x = ...``, a module-level ``_x``): the static type of an
   object is unknown, and a private name that none of our classes define comes from a library, in
   practice DeepSpeed's engines/optimizers or torch's modules and tensors. A name the internals
   modules touch on a foreign object is always foreign, even when one of our classes happens to
   define it too, except on ``self``/``cls``;
4. writing an attribute of a DeepSpeed engine (a name or attribute called ``engine`` or ``*_engine``):
   ``engine.allreduce_gradients = ...``, ``self.engine.global_steps = ...``. The engine's attributes are
   its state and methods; replacing them is patching DeepSpeed, public name or not.

Not a touch: our own private helpers (``self._cache``, ``module._helper`` of a megatron module),
dunders, and private names of other libraries reached through their module (``os._exit`` is public
API; ``numpy._core`` is numpy's business).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERNALS = ("megatron/deepspeed_internals.py", "megatron/torch_internals.py")
ENTRY_SCRIPTS = ("deepy.py", "train.py", "generate.py", "eval.py", "prepare_data.py")
GUARDED_ROOTS = {"torch", "deepspeed"}
ENGINE_NAME = re.compile(r"(^|_)engine$")


@dataclass(frozen=True)
class Touch:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scanned_files(root: Path = REPO) -> list[Path]:
    files = [p for p in sorted((root / "megatron").rglob("*.py")) + sorted((root / "tools").rglob("*.py"))]
    files += [root / name for name in ENTRY_SCRIPTS if (root / name).exists()]
    return [p for p in files if "__pycache__" not in p.parts]


def own_private_names(trees: list[ast.Module]) -> set[str]:
    """Private names our code defines: class members, ``self._x``/``cls._x`` targets, module globals."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                and leaf.value.id in ("self", "cls"):
                            names.add(leaf.attr)
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") \
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id in ("self", "cls") and isinstance(node.args[1], ast.Constant):
                names.add(str(node.args[1].value))  # object.__setattr__(self, "_x", ...) in a __setattr__ class
    return {n for n in names if is_private(n)}


def foreign_private_names(internals: list[ast.Module]) -> set[str]:
    """Private names the internals modules reach on objects other than ``self``: known foreign."""
    names: set[str] = set()
    for tree in internals:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr) \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                    and is_private(node.args[1].value):
                names.add(node.args[1].value)
    return names


def _root(module: str) -> str:
    return module.split(".", 1)[0]


def _imported_roots(tree: ast.Module) -> dict[str, str]:
    """Local name -> top-level package it was imported from (at any depth of the file)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".", 1)[0]] = _root(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = _root(node.module)
    return bound


def _chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); the root is None when the chain starts at a call, subscript, ..."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _names_engine(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return bool(ENGINE_NAME.search(node.id))
    return isinstance(node, ast.Attribute) and bool(ENGINE_NAME.search(node.attr))


def touches_in(tree: ast.Module, where: str, own: set[str], foreign: set[str]) -> list[Touch]:
    """Every private DeepSpeed/torch touch in one parsed file (the rules of the module docstring)."""
    found: list[Touch] = []
    imported = _imported_roots(tree)
    reported: set[int] = set()

    def object_private(name: str, base: ast.expr) -> bool:
        on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
        if name in foreign and not on_self:
            return True
        return name not in own

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root(alias.name) in GUARDED_ROOTS and any(is_private(p) for p in alias.name.split(".")):
                    found.append(Touch(where, node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and _root(node.module) in GUARDED_ROOTS:
            parts = node.module.split(".") + [alias.name for alias in node.names]
            if any(is_private(p) for p in parts):
                found.append(Touch(where, node.lineno, f"from {node.module} import "
                                   + ", ".join(alias.name for alias in node.names)))
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            root, attrs = _chain(node)
            package = imported.get(root) if root is not None else None
            if package is not None and root not in ("self", "cls"):
                if package in GUARDED_ROOTS and id(node) not in reported:  # rule 2
                    found.append(Touch(where, node.lineno, f"{root}.{'.'.join(attrs)}"))
                    inner = node.value
                    while isinstance(inner, ast.Attribute):  # one report per chain: torch._C._x
                        reported.add(id(inner))
                        inner = inner.value
                continue  # another library's module, or one of ours
            if object_private(node.attr, node.value):  # rule 3
                found.append(Touch(where, node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value) \
                    and object_private(name.value, node.args[0]):
                found.append(Touch(where, node.lineno, f"{node.func.id}(..., {name.value!r})"))
            elif node.func.id in ("setattr", "delattr") and _names_engine(node.args[0]):  # rule 4
                found.append(Touch(where, node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, ...)"))
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Delete)):  # rule 4
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and _names_engine(leaf.value):
                        found.append(Touch(where, node.lineno, f"writes {ast.unparse(leaf)}"))
    return found


def scan(root: Path = REPO) -> list[Touch]:
    files = scanned_files(root)
    trees = {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in files}
    internals = [trees[root / rel] for rel in INTERNALS if (root / rel) in trees]
    own = own_private_names([t for p, t in trees.items() if p.relative_to(root).as_posix() not in INTERNALS])
    foreign = foreign_private_names(internals)
    found: list[Touch] = []
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        if rel not in INTERNALS:
            found += touches_in(tree, rel, own, foreign)
    return found


def test_no_private_deepspeed_or_torch_touch_outside_the_internals_modules() -> None:
    touches = scan()
    assert not touches, (
        "private DeepSpeed/torch API used outside megatron/deepspeed_internals.py and "
        "megatron/torch_internals.py; move it behind a named function there (and pin it in "
        "tests/unit/test_deepspeed_internals.py or test_torch_internals.py):\n"
        + "\n".join(str(t) for t in touches)
    )


def test_the_internals_modules_exist_and_are_scanned() -> None:
    files = {p.relative_to(REPO).as_posix() for p in scanned_files()}
    assert set(INTERNALS) <= files
    assert {"megatron/training/loop.py", "deepy.py", "train.py"} <= files
    assert any(name.startswith("tools/") for name in files)


def _touches(snippet: str, own: set[str] = frozenset(), foreign: set[str] = frozenset()) -> list[str]:
    return [t.what for t in touches_in(ast.parse(snippet), "snippet.py", set(own), set(foreign))]


def test_each_kind_of_private_touch_is_reported() -> None:
    assert _touches("import torch._dynamo") == ["import torch._dynamo"]
    assert _touches("from torch._utils import _flatten_dense_tensors") == [
        "from torch._utils import _flatten_dense_tensors"]
    assert _touches("from deepspeed.runtime.activation_checkpointing.checkpointing import _CUDA_RNG_STATE_TRACKER")
    assert _touches("import torch\nx = torch._C._get_tracing_state()") == ["torch._C._get_tracing_state"]
    assert _touches("import torch\ntorch.cuda.memory._dump_snapshot('p')") == ["torch.cuda.memory._dump_snapshot"]
    assert _touches("from torch import nn\nnn.Module._apply") == ["nn.Module._apply"]
    assert _touches("def f(engine):\n    return engine._config") == ["engine._config"]
    assert _touches("def f(t):\n    return t._version") == ["t._version"]
    assert _touches("def f(p):\n    return hasattr(p, '_hp_mapping')") == ["hasattr(..., '_hp_mapping')"]
    assert _touches("def f(engine, g):\n    engine.allreduce_gradients = g") == [
        "writes engine.allreduce_gradients"]
    assert _touches("def f(self):\n    self.engine.global_steps = 3") == ["writes self.engine.global_steps"]
    assert _touches("def f(model_engine):\n    setattr(model_engine, 'x', 1)") == ["setattr(model_engine, ...)"]
    # a name one of our classes defines is still foreign on another object when the internals touch it
    assert _touches("def f(engine):\n    return engine._config", own={"_config"}, foreign={"_config"})


def test_our_own_private_names_and_other_libraries_are_not_reported() -> None:
    assert _touches("class A:\n    def _f(self):\n        return self._g()\n    def _g(self):\n        return 1",
                    own={"_f", "_g"}) == []
    assert _touches("def f(other):\n    return other._cache", own={"_cache"}) == []
    assert _touches("import os\nos._exit(0)") == []
    assert _touches("import torch\nv = torch.__version__") == []
    assert _touches("from megatron.checkpointing import safe_load\nsafe_load._explain") == []
    assert _touches("def f(self):\n    self._config = 1\n    return self._config", own={"_config"},
                    foreign={"_config"}) == []
    assert _touches("def f(engine):\n    return engine.global_steps") == []  # reading is fine, writing is not


def test_own_private_names_are_collected_from_definitions() -> None:
    tree = ast.parse("_TABLE = {}\nclass A:\n    _kind = 1\n    def _f(self):\n        self._x = 1\n"
                     "        object.__setattr__(self, '_z', 3)\n"
                     "def g(obj):\n    obj._y = 2\n")
    assert own_private_names([tree]) == {"_TABLE", "_kind", "_f", "_x", "_z"}  # obj._y is a write, not a definition


def test_scan_reports_a_touch_in_a_module_but_not_in_the_internals_modules(tmp_path: Path) -> None:
    touch = "def f(engine):\n    return engine._config\n"
    for rel in ("megatron/deepspeed_internals.py", "megatron/torch_internals.py", "megatron/x/y.py", "tools/t.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(touch)
    (tmp_path / "train.py").write_text("import torch._dynamo\n")
    assert sorted(str(t) for t in scan(tmp_path)) == [
        "megatron/x/y.py:2: engine._config", "tools/t.py:2: engine._config", "train.py:1: import torch._dynamo"]
