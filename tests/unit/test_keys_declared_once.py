"""Each supported key is declared in exactly one config class (issue 20, item 1).

A *config class* is an argument group under ``megatron/`` (an ``ArgGroup``: the groups, plug-ins'
keys), a class named ``*Config``, or a class with a ``from_args`` constructor (one that copies keys
out of the argument object). The one argument object ``NeoXArgs``
is composed of the groups by inheritance, so it declares nothing itself.

Every component has been converted (the last, generation, gave up ``GenerationConfig`` and ``SamplingConfig``):
no config class copies keys through ``from_args``, and any config class declaring an already-declared key
fails the test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from megatron.neox_arguments.arguments import NeoXArgs

ROOT = Path(__file__).resolve().parents[2] / "megatron"

NESTED_VALUES: dict[str, str] = {
    "_Params": "members of the optimizer block's params (DeepSpeed's spelling of lr and weight_decay inside "
               "optimizer:); the rules refuse a block value that disagrees with its flat key",
}
"""Argument groups used as the type of a key's nested value, not declaring top-level keys."""

_NODE = ("a node of the run's tree of the components' groups (issue 46): each field is a group's own instance "
         "(``component_groups.group``), so ``checkpoint`` there is the checkpoint keys' group, not DeepSpeed's "
         "``checkpoint`` block")
TREE: dict[str, str] = {
    "RunConfig": _NODE + "; ``from_args`` builds the groups, it declares no key",
    "TrainConfig": _NODE,
    "EngineConfig": _NODE,
}
"""Config classes whose fields are groups, not keys."""

ARG_GROUP_BASES = {"ArgGroup"}
"""A pydantic model is a config class when it is an argument group (top-level keys); the models of a
key's nested value (a tracker entry, the optimizer block's params) declare members of that value, not keys."""


def _config_classes(root: Path) -> dict[str, tuple[str, ast.ClassDef]]:
    """``name -> (file, class)`` of every config class under ``root`` (see the module docstring)."""
    found: dict[str, tuple[str, ast.ClassDef]] = {}
    pydantic = set(ARG_GROUP_BASES)
    trees = [(path, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(root.rglob("*.py"))]
    for _ in range(3):  # subclasses of subclasses of ArgGroup, across files
        for _, tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and {_name(b) for b in node.bases} & pydantic:
                    pydantic.add(node.name)
    for path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            copies = any(isinstance(s, ast.FunctionDef) and s.name == "from_args" for s in node.body)
            if node.name in NESTED_VALUES:
                continue
            if node.name in pydantic or node.name.endswith("Config") or copies:
                found[node.name] = (str(path.relative_to(root.parent)), node)
    return found


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _declared_fields(node: ast.ClassDef) -> set[str]:
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _copies(node: ast.ClassDef) -> bool:
    return any(isinstance(s, ast.FunctionDef) and s.name == "from_args" for s in node.body)


def declarations(root: Path, exempt: set[str]) -> dict[str, list[str]]:
    """key -> the config classes declaring a field of that name (``file:Class``), exempt classes left out."""
    keys = set(NeoXArgs.field_names())
    where: dict[str, list[str]] = defaultdict(list)
    for name, (path, node) in _config_classes(root).items():
        if name in exempt:
            continue
        for field in _declared_fields(node) & keys:
            where[field].append(f"{path}:{name}")
    return where


def test_each_supported_key_is_declared_in_exactly_one_config_class() -> None:
    where = declarations(ROOT, set(TREE))
    missing = sorted(k for k in NeoXArgs.field_names() if k not in where)
    twice = {k: v for k, v in where.items() if len(v) > 1}
    assert not missing, f"keys of NeoXArgs declared in no config class under megatron/: {missing}"
    assert not twice, f"keys declared in more than one config class: {twice}"


def test_no_config_class_copies_from_the_arguments() -> None:
    copying = sorted(n for n, (_, node) in _config_classes(ROOT).items() if _copies(node) and n not in TREE)
    assert copying == [], f"new from_args copies of the arguments: {copying}; declare the keys once instead"


def test_the_check_finds_a_second_declaration(tmp_path: Path) -> None:
    """The test of the test: a copy of a key in a new config class (or a new from_args) is reported."""
    package = tmp_path / "megatron"
    package.mkdir()
    (package / "a.py").write_text(
        "from megatron.config_schema import ArgGroup\n\nclass ModelArgs(ArgGroup):\n    hidden_size: int = 0\n",
        encoding="utf-8")
    (package / "b.py").write_text(
        "class WidthConfig:\n    hidden_size: int\n\n    @classmethod\n    def from_args(cls, args):\n"
        "        return cls(hidden_size=args.hidden_size)\n", encoding="utf-8")
    where = declarations(package, exempt=set())
    assert where["hidden_size"] == ["megatron/a.py:ModelArgs", "megatron/b.py:WidthConfig"]
    assert _copies(_config_classes(package)["WidthConfig"][1])
