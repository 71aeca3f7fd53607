"""Which tests name which config keys: the index the honesty test checks every supported key against.

A key counts as shown to have an effect when a test that can observe behaviour names it: a ``test_*``
function, together with the module-level constants, helpers and fixtures it uses (followed
transitively, so a key set in a shared ``BASE`` dict or a module fixture counts for the tests reading
that fixture), spells the key, literally or as an f-string template (``f"pos_{split}_data_paths"``).

Tests that only check that keys are parsed, refused or documented are not effect tests and are left
out: the schema, rules, loading, override and docs files, and functions named for refusals or
messages. Keys handed to DeepSpeed count only in the tests that read DeepSpeed's own state after it
parsed or initialised them (:data:`DEEPSPEED_STATE_TESTS`).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONFIG_ONLY_FILES = frozenset({
    "test_schema.py", "test_config_rules.py", "test_docs_fresh.py", "test_config_honesty.py", "test_neox_configs.py",
    "test_config_loading.py", "test_overrides.py", "test_config_any_value.py", "test_objective_rules.py",
    "test_moe_config.py", "test_suite_layout.py", "test_readme_commands.py",
})  # fmt: skip
"""Files whose tests check parsing, refusals and docs, not what a key does."""

REFUSAL_NAME = re.compile(r"refus|reject|mistake|error|invalid|bad|unknown|typo|clash|conflict|disagree|"
                          r"name_the|names_the|not_supported|message")

DEEPSPEED_STATE_TESTS = frozenset({
    "tests/distributed/test_deepspeed_blocks.py::test_blocks_reach_deepspeeds_state",
    "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
})  # fmt: skip
"""Tests that read DeepSpeed's state (its engine after ``initialize``, or its parsed config)."""


@dataclass(frozen=True)
class TestSource:
    __test__ = False  # a record about a test, not a test class for pytest to collect

    node_id: str
    """``path::function``."""
    text: str
    """The function with its decorators and everything module-level it uses, transitively."""

    @functools.cached_property
    def words(self) -> frozenset[str]:
        return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", self.text))

    @functools.cached_property
    def templates(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_templates(self.text))


def _module_definitions(tree: ast.Module, source: str) -> dict[str, tuple[str, ast.AST]]:
    found: dict[str, tuple[str, ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = (ast.get_source_segment(source, node) or "", node)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("test_"):
            found[node.name] = (ast.get_source_segment(source, node) or "", node)
    return found


def _names_used(node: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, ast.FunctionDef):
        used |= {a.arg for a in node.args.args}  # fixtures arrive as arguments
    return used


def sources_of_tests(path: Path) -> list[TestSource]:
    source = path.read_text()
    tree = ast.parse(source)
    definitions = _module_definitions(tree, source)
    out = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        parts = [ast.get_source_segment(source, d) or "" for d in node.decorator_list]
        parts.append(ast.get_source_segment(source, node) or "")
        seen: set[str] = set()
        todo = set(_names_used(node)) | {n for d in node.decorator_list for n in _names_used(d)}
        while todo:
            name = todo.pop()
            if name in seen or name not in definitions:
                continue
            seen.add(name)
            text, definition = definitions[name]
            parts.append(text)
            todo |= _names_used(definition) - seen
        out.append(TestSource(f"{path.relative_to(REPO)}::{node.name}", "\n".join(parts)))
    return out


def effect_tests(root: Path = REPO / "tests") -> list[TestSource]:
    """Every test function that can observe behaviour (see the module doc)."""
    return [t for path in sorted(root.rglob("test_*.py")) if path.name not in CONFIG_ONLY_FILES
            for t in sources_of_tests(path) if not REFUSAL_NAME.search(t.node_id.split("::")[1])]


def _templates(text: str) -> list[re.Pattern[str]]:
    """f-string key templates in ``text``: ``f"pos_{split}_data_paths"`` -> ``pos_\\w+_data_paths``."""
    out = []
    for literal in re.findall(r"""f["']([a-z_{}]+)["']""", text):
        if "{" in literal and "_" in literal:
            out.append(re.compile("^" + re.sub(r"\{[a-z_]+\}", r"[a-z]+", literal) + "$"))
    return out


def naming_tests(key: str, tests: Iterable[TestSource]) -> list[str]:
    return [t.node_id for t in tests if key in t.words or any(p.match(key) for p in t.templates)]
