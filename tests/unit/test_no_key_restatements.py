"""A config key is declared once, in the ArgGroup of the component that reads it (issue 34): no Protocol
elsewhere in megatron/ restates it as a property stub, so a key's type lives in one place and the type
checker (mypy, .ci/run) checks every reader against it.

Read from the source (ast): every class deriving from ``Protocol`` whose body declares a name that is a
key of :class:`NeoXArgs` (an annotated attribute or a ``@property``). There are none: a component is
handed its own group, or a frozen object of values resolved once (``neox_arguments/run_config.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from megatron.neox_arguments.arguments import NeoXArgs

ROOT = Path(__file__).resolve().parents[2]


def _is_protocol(node: ast.ClassDef) -> bool:
    return any((isinstance(b, ast.Name) and b.id == "Protocol") or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
               for b in node.bases)


def _declared(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        if isinstance(item, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
            names.add(item.name)
    return names


def restating_protocols(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """``path:Class`` -> the NeoXArgs keys that Protocol declares again."""
    keys = set(NeoXArgs.field_names())
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and _is_protocol(node) and (_declared(node) & keys):
                found[f"{path.relative_to(root).as_posix()}:{node.name}"] = _declared(node) & keys
    return found


def test_no_protocol_restates_a_declared_key() -> None:
    found = {name: sorted(keys) for name, keys in restating_protocols(sorted((ROOT / "megatron").rglob("*.py"))).items()}
    assert not found, ("Protocols restating config keys (hand the component the ArgGroup that declares them, or "
                       f"a frozen object of the values derived once): {found}")


def test_the_scan_finds_a_restatement(tmp_path: Path) -> None:
    """The scan itself can fail: a Protocol declaring ``seq_length`` is found, a plain class is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import Protocol\n\nclass Probe(Protocol):\n    @property\n"
                     "    def seq_length(self) -> int: ...\n\nclass Plain:\n    seq_length: int\n")
    assert restating_protocols([probe], tmp_path) == {"probe.py:Probe": {"seq_length"}}
