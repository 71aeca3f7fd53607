"""How the project's programs find their code: no ``sys.path`` edits outside tests, console scripts that resolve.

Scripts beside the packages (``deepy.py``, ``prepare_data.py``) rely on Python putting their own folder
first on ``sys.path``; the tools under ``tools/`` are a package, run as the console scripts ``setup.py``
declares, as ``python -m tools....`` from the repository root, or as ``python tools/....py`` once the
project is installed. A ``sys.path.insert`` would make a tool import whichever checkout sits next to
it instead of the one installed, and hides a missing install until a user's machine finds it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".eggs", "node_modules"}


def sys_path_edits(source: str, filename: str = "<source>") -> list[int]:
    """Lines that change ``sys.path``: a call of one of its methods (``insert``, ``append``, ``extend``,
    ...), an assignment to it or to an item or slice of it, or an augmented assignment."""

    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)  # sys.path.insert(...), .append(...), .extend(...), .remove(...)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                    lines.append(node.lineno)  # sys.path = ..., sys.path[:0] = ..., sys.path += ...
    return sorted(lines)


def test_the_check_finds_every_form_of_sys_path_edit() -> None:
    edits = """import sys
sys.path.insert(0, "a")
sys.path.append("b")
sys.path.extend(["c"])
sys.path[:0] = ["d"]
sys.path = ["e"]
sys.path += ["f"]
def later():
    sys.path.insert(0, "g")
"""
    assert sys_path_edits(edits) == [2, 3, 4, 5, 6, 7, 9]
    reads = 'import sys\nprint(sys.path[0], "x" in sys.path, list(sys.path))\nos.path.join("a")\npath.append(1)\n'
    assert sys_path_edits(reads) == []


INTERPRETER_STARTUP = {"megatron/launcher/local_ranks.py": "sys.path[0] = os.path.dirname(os.path.abspath(script))"}
"""The one allowed edit: a rank forked by the per-node launcher gets the ``sys.path[0]`` that ``python SCRIPT``
gives a fresh interpreter (the script's folder), nothing added."""


def test_no_sys_path_edits_outside_tests() -> None:
    found = []
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] == "tests" or SKIP_DIRS & set(parts):
            continue
        text = path.read_text()
        lines = text.splitlines()
        allowed = INTERPRETER_STARTUP.get(str(path.relative_to(REPO)))
        found += [f"{path.relative_to(REPO)}:{line}" for line in sys_path_edits(text, str(path))
                  if allowed is None or lines[line - 1].split("#")[0].strip() != allowed]
    assert not found, f"sys.path changed outside tests (declare a console script or run as a module): {found}"


def console_scripts() -> dict[str, str]:
    """``name -> module:function`` of setup.py's console scripts (read from its CONSOLE_SCRIPTS list)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (entries,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "CONSOLE_SCRIPTS" for t in node.targets)]
    setup_call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry_points = next(k.value for k in setup_call.keywords if k.arg == "entry_points")
    assert ast.unparse(entry_points) == "{'console_scripts': CONSOLE_SCRIPTS}"
    return dict((part.strip() for part in entry.split("=")) for entry in entries)


def test_every_user_facing_tool_has_a_console_script() -> None:
    targets = set(console_scripts().values())
    tools = {f"tools.{p.parent.name}.{p.stem}:cli" for p in (REPO / "tools").glob("[!_]*/*.py")
             if p.parent.name in ("datasets", "ckpts") and not p.stem.startswith("_")}
    assert tools | {"tools.plot_metrics:cli", "tools.gpu_check.cli:cli"} == targets
    readme = (REPO / "README.md").read_text()
    assert [name for name in console_scripts() if f"`{name}`" not in readme] == []  # the README lists them all


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_script_runs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the installed ``name`` command does: import the module, call the function (here with --help)."""
    module, function = console_scripts()[name].split(":")
    entry = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        entry()
    assert done.value.code == 0 and out.getvalue().startswith(f"usage: {name} ")


def test_a_tool_runs_as_a_module_from_the_repository_root() -> None:
    """``python -m tools.datasets.build_preference_data`` from the root, no PYTHONPATH: ``-m`` puts the working
    directory first on sys.path, so the tool, the sibling tool it imports and megatron come from here."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "tools.datasets.build_preference_data", "--input", "missing.jsonl"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing.jsonl not found" in proc.stderr, proc.stderr


SCRIPTS = ["train.py", "generate.py", "eval.py", "prepare_data.py",
           *sorted(str(p.relative_to(REPO)) for p in (REPO / "tools" / "bench").glob("[!_]*.py")
                   if 'if __name__ == "__main__"' in p.read_text())]  # harness.py, nanogpt.py: libraries
"""The scripts without a console script: the workers deepy.py starts, the corpus builder, the benchmarks."""


def test_deepy_help_exits_0() -> None:
    """Issue 32: ``python deepy.py --help`` said "the following arguments are required" with exit code 2."""
    proc = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: deepy.py [--dry-run] [--verbose] [--debug]")
    assert "--verbose" in proc.stdout and "examples (from the repository root" in proc.stdout and proc.stderr == ""


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import runpy

    import megatron.initialize

    def leave(code: int | str | None) -> None:  # the workers leave through os._exit: not out of pytest
        raise SystemExit(code)

    monkeypatch.setattr(megatron.initialize, "exit_process", leave)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert done.value.code in (0, None) and out.getvalue().startswith("usage: "), out.getvalue()[:300]
