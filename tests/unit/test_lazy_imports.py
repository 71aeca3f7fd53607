"""An import inside a function says why it is not at the top of its module.

A module imports what it needs at its top, where a reader sees its dependencies (and
``tests/unit/test_import_graph.py`` counts them either way). An import stays inside a function only to keep
a heavy or optional package out of a light start-up: ``deepy.py``'s checks and ``--dry-run`` run without
torch and DeepSpeed (``tests/unit/test_launch_startup_cost.py``), the offline tools without DeepSpeed, and
wandb, lm-eval, boto3, transformers, pytorch-optimizer, peft or mamba-ssm are read only by the runs that
use them. Each such import carries a ``# lazy: <why>`` comment, on its line or heading the run of imports
it belongs to.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("train.py", "deepy.py", "generate.py", "eval.py")
MARK = "lazy:"


def _in_function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement inside a function (or lambda), at any depth, in source order."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child, inside)

    visit(tree, False)
    return sorted(found, key=lambda node: node.lineno)


def unexplained_imports(path: Path, root: Path) -> tuple[int, list[str]]:
    """(in-function imports of ``path``, ``file:line: import`` of those without a ``# lazy:`` reason). A reason
    is a comment holding ``lazy:`` on the import's first line, or on the line above the run of consecutive
    import lines the import belongs to."""
    text = path.read_text()
    lines = text.splitlines()
    imports = _in_function_imports(ast.parse(text, str(path)))
    import_lines = {line for node in imports for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    missing = []
    for node in imports:
        if MARK in lines[node.lineno - 1].partition("#")[2]:
            continue
        above = node.lineno - 1
        while above in import_lines and MARK not in lines[above - 1].partition("#")[2]:
            above -= 1  # up the run of imports, to the comment that heads it
        heading = lines[above - 1].strip() if above >= 1 else ""
        if not (heading.startswith("#") and MARK in heading):
            missing.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return len(imports), missing


def _sources(root: Path) -> list[Path]:
    return [*sorted((root / "megatron").rglob("*.py")), *(root / name for name in ENTRY_POINTS if (root / name).exists())]


def test_every_import_inside_a_function_says_why() -> None:
    total, missing = 0, []
    for path in _sources(REPO):
        count, unexplained = unexplained_imports(path, REPO)
        total += count
        missing += unexplained
    print(f"{total} imports inside functions, {total - len(missing)} with a '# lazy:' reason")
    assert missing == [], (
        f"{len(missing)} of {total} imports inside functions give no reason: move each to the top of its module, or "
        "say on its line (or above its run of imports) what it keeps out of a light start-up, as '# lazy: <why>':\n"
        + "\n".join(missing))


# --- the reader, on files written here ------------------------------------------------------------------
TOY = '''\
import os


def explained():
    import torch  # lazy: torch is not imported by the launcher
    return torch


def heading():
    # lazy: DeepSpeed takes seconds to import
    import deepspeed
    from deepspeed.pipe import PipelineModule
    return deepspeed, PipelineModule


def bare():
    from megatron.errors import ConfigError
    return ConfigError


def after_code():
    # lazy: a reason for the first run only
    import json

    x = 1
    import csv
    return json, csv, x


class Holder:
    def method(self):
        helper = lambda: __import__("os")  # not an import statement
        import re
        return re, helper
'''


def test_the_reader_names_imports_without_a_reason(tmp_path: Path) -> None:
    (tmp_path / "toy.py").write_text(TOY)
    total, missing = unexplained_imports(tmp_path / "toy.py", tmp_path)
    assert total == 7  # module-level imports do not count
    assert missing == ["toy.py:17: from megatron.errors import ConfigError", "toy.py:26: import csv",
                       "toy.py:33: import re"]
