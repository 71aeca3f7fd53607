"""megatron/ has no import cycles: its modules form layers a reader can take one at a time.

The graph is read from the source with ``ast``, never by importing it, and counts **every** import
of a package module, wherever it is written:

* at module level;
* inside a function (a "lazy" import): the module still cannot do its work without the other one,
  and moving an import into a function is how a cycle is hidden, not how it is broken;
* under ``if TYPE_CHECKING:``: the two modules still name each other's concepts (the cycle between
  ``logging/preflight.py`` and ``neox_arguments/rules.py`` was one of these);
* ``importlib.import_module("megatron....")`` with a literal name, and the names a package exports
  lazily (PEP 562) through an ``_EXPORTS`` dict: ``from megatron.launcher import plan_launch`` is an
  edge to ``megatron.launcher.command``, the module that defines it;
* a module named by a string: a string literal that is exactly the dotted name of a module of the package,
  optionally with ``:attribute`` (``"megatron.tokenizer.hf:HFTokenizer"``, a registry's ``"module:attr"``
  target, a table of modules to import, ``python -m megatron.launcher.local_ranks``'s name), is an edge
  from the file that holds it: whatever imports it by that name, the file names the module it needs.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module and to ``pkg`` otherwise. A
package's ``__init__`` that Python runs on the way to a submodule is not an edge of its own (as in
import-linter/grimp): otherwise every package that re-exports a name would be a cycle with its
submodules.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``root/package``."""
    names: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _lazy_exports(module: str, tree: ast.Module) -> dict[str, str]:
    """A package's PEP 562 exports: exported name -> dotted module that defines it."""
    exports: dict[str, str] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
            for name, where in ast.literal_eval(node.value).items():
                exports[name] = where if where.startswith(module.split(".")[0] + ".") else f"{module}.{where}"
    return exports


def _module_getattr(tree: ast.Module) -> ast.stmt | None:
    """The statement defining a module's ``__getattr__`` (PEP 562): a function, or an assignment
    (``__getattr__ = lazy_exports(__name__, _EXPORTS)``)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets):
            return node
    return None


def _import_sites(tree: ast.Module, text: str, package: str) -> Iterator[ast.AST]:
    """The nodes of ``tree`` that can import, breadth first as ``ast.walk``: every statement at any depth (an
    import is a statement, in any statement's body), and every node of a file that names ``import_module`` or
    holds a string starting with the package's name (a call or a string can sit in any expression). Walking
    only the statements of the other files keeps this test's graph quick."""
    if "import_module" in text or f'"{package}.' in text or f"'{package}." in text:
        yield from ast.walk(tree)
        return
    todo: deque[ast.AST] = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case)))


def import_graph(root: Path, package: str) -> nx.DiGraph:
    """Edges ``importer -> imported`` between the modules of ``package``; each edge's ``where`` is the
    ``file:line`` of the import."""
    modules = _module_names(root, package)
    texts = {name: path.read_text() for name, path in modules.items()}
    trees = {name: ast.parse(texts[name], str(path)) for name, path in modules.items()}
    exports = {name: _lazy_exports(name, tree) for name, tree in trees.items()}
    lazy_without_exports = [
        str(modules[name].relative_to(root)) for name, tree in trees.items()
        if _module_getattr(tree) is not None and not exports[name]
    ]
    assert not lazy_without_exports, (
        f"{lazy_without_exports}: a module __getattr__ (PEP 562) without an _EXPORTS dict hides its imports "
        f"from this graph; list the names it exports in _EXPORTS")

    def owner(dotted: str) -> str | None:
        """The package module ``dotted`` names, or the one holding it (``a.b.Name`` -> ``a.b``)."""
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for importer, tree in trees.items():
        is_package = modules[importer].name == "__init__.py"
        for node in _import_sites(tree, texts[importer], package):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the importer's package, one level up per extra dot
                    base = importer.split(".")[: None if is_package else -1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    name = f"{source}.{alias.name}"
                    targets.append(name if name in modules else exports.get(source, {}).get(alias.name, source))
            elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                  and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                targets = [node.args[0].value]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = node.value.partition(":")[0]  # "pkg.module" or "pkg.module:attribute"
                if (named.startswith(f"{package}.") and named in modules
                        and (named == node.value or node.value.partition(":")[2].isidentifier())):
                    targets = [named]
            for target in targets:
                imported = owner(target) if target.split(".")[0] == package else None
                if imported is not None and imported != importer:
                    graph.add_edge(importer, imported, where=f"{modules[importer].relative_to(root)}:{node.lineno}")
    return graph


def cycles(graph: nx.DiGraph) -> list[list[tuple[str, str, str]]]:
    """One cycle per tangle (strongly connected component of more than one module), as its edges
    ``(importer, imported, file:line)``; empty when the modules form layers."""
    found = []
    for tangle in sorted(nx.strongly_connected_components(graph), key=sorted):
        if len(tangle) > 1:
            sub = graph.subgraph(tangle)
            start = min(tangle)
            found.append([(a, b, sub.edges[a, b]["where"]) for a, b in nx.find_cycle(sub, source=start)])
    return found


def describe(cycle: list[tuple[str, str, str]]) -> str:
    path = " -> ".join([cycle[0][0], *(b for _, b, _ in cycle)])
    return path + "\n" + "\n".join(f"    {a} imports {b} at {where}" for a, b, where in cycle)


@pytest.fixture(scope="module")
def megatron_graph() -> nx.DiGraph:
    return import_graph(REPO, "megatron")


def test_megatron_has_no_import_cycles(megatron_graph: nx.DiGraph) -> None:
    graph = megatron_graph
    assert graph.number_of_edges() > 300  # the reader sees the package's imports (about 700 of them)
    found = cycles(graph)
    assert not found, (
        f"{len(found)} import cycle(s) in megatron/; move the code that both modules need to where it "
        f"belongs (an import inside a function or under TYPE_CHECKING still counts):\n"
        + "\n".join(describe(c) for c in found))


def test_nothing_below_imports_the_app(megatron_graph: nx.DiGraph) -> None:
    """``megatron/app/`` composes everything else; a component importing it would invert the layers."""
    graph = megatron_graph
    app = {m for m in graph if m == "megatron.app" or m.startswith("megatron.app.")}
    upward = sorted(graph.edges[a, b]["where"] for a, b in graph.edges if b in app and a not in app)
    assert app and upward == []


def argument_layer_importers(graph: nx.DiGraph, package: str = "megatron") -> list[str]:
    """``file:line`` of every import of ``<package>.neox_arguments`` from a module outside it and ``<package>.app``."""
    layer, app = f"{package}.neox_arguments", f"{package}.app"
    inside = {m for m in graph if m == layer or m.startswith(layer + ".")}
    above = {m for m in graph if m == app or m.startswith(app + ".")} | inside
    return sorted(graph.edges[a, b]["where"] for a, b in graph.edges if b in inside and a not in above)


def test_components_do_not_import_the_argument_layer(megatron_graph: nx.DiGraph) -> None:
    """Dependencies point down: a component gets its keys as its own group (or a typed object built from the
    arguments), never by importing ``megatron.neox_arguments``, which composes the components' groups. The
    resolved config file is read by the programs on top: ``train.py`` and ``megatron/app/workers.py``
    (``generate.py``, ``eval.py``)."""
    assert any(m.startswith("megatron.neox_arguments") for m in megatron_graph)
    found = argument_layer_importers(megatron_graph)
    assert found == [], f"components importing the argument layer: {found}"


LAYERS: tuple[tuple[str, ...], ...] = (
    ("app", "__init__"),  # deepy.py's command and the ranks' programs; megatron/__init__.py installs the console filters
    ("neox_arguments",),  # the argument layer: composes every component's keys, checks them before launch
    ("evaluation",),  # eval.py, and lm-eval inside training: runs the model through generation's replica
    ("training", "generation"),  # train.py's loop; generate.py (neither imports the other: both build through the engine)
    ("engine", "interop"),  # the model, DeepSpeed engine, optimizer, LR schedule, memory estimate; offline conversion
    ("objectives",),  # train_impl's losses and references: the engine builds a pipeline's loss from one
    ("checkpointing",),  # save/load, retention/commit, layout change, GPT-NeoX's format
    ("data", "model", "tokenizer", "initialize"),
    ("launcher",),
    ("logging",),
    ("mpu",),
    ("objective_needs",),  # what an objective needs of the data and model, read from its plug-in entry
    ("plugins",),
    ("config_rules",),
    ("object_store",),  # s3:// and fsspec's schemes: checkpoints, data and the checks before launch
    ("config_schema", "config_support", "errors", "time_phrases", "atomic_files", "lazy", "torch_internals",
     "deepspeed_internals", "devices"),
)
"""The packages (and top-level modules) of ``megatron/``, top to bottom: a module imports only modules of
the layers below its own; the packages of one layer do not import each other. No exception is listed."""


def _unit(module: str) -> str:
    """The package of ``megatron/`` (or top-level module) ``module`` belongs to: its layer's name."""
    return module.split(".")[1] if "." in module else "__init__"


def layering_violations(graph: nx.DiGraph, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """``file:line: importer -> imported`` for every import that does not point to a lower layer."""
    level = {unit: index for index, units in enumerate(layers) for unit in units}
    found = []
    for importer, imported in graph.edges:
        a, b = _unit(importer), _unit(imported)
        if a == b:
            continue
        if level[a] >= level[b]:
            found.append(f"{graph.edges[importer, imported]['where']}: {importer} ({a}) imports {imported} ({b})")
    return sorted(found)


def test_packages_form_the_named_layers(megatron_graph: nx.DiGraph) -> None:
    """Dependencies point down, package by package: ``data`` never imports ``training`` (the objective's
    needs are ``megatron/objective_needs.py``), ``data`` never imports ``generation`` (the reference
    log-probs' reader is ``data/reference_logprobs.py``), ``training`` never imports ``evaluation`` or
    ``generation`` (``train.py`` hands ``pretrain`` the lm-eval runner), ``checkpointing`` never imports
    ``interop``."""
    graph = megatron_graph
    unplaced = sorted({_unit(m) for m in graph} - {unit for units in LAYERS for unit in units})
    assert unplaced == [], f"place these in LAYERS (test_import_graph.py): {unplaced}"
    found = layering_violations(graph)
    assert found == [], "imports that point up the layers (LAYERS in tests/unit/test_import_graph.py):\n" + "\n".join(found)


def test_one_lazy_export_helper() -> None:
    """Every package that exports names on first use takes its ``__getattr__`` from ``megatron/lazy.py``."""
    own = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        text = path.read_text()
        node = _module_getattr(ast.parse(text, str(path))) if "__getattr__" in text else None  # parse only those
        if node is None:
            continue
        uses_helper = (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                       and getattr(node.value.func, "id", None) == "lazy_exports")
        if not uses_helper:
            own.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert own == [], f"a module __getattr__ of its own; use __getattr__ = lazy_exports(__name__, _EXPORTS): {own}"


def test_lazy_exports_import_on_first_read() -> None:
    from megatron.lazy import lazy_exports

    getattr_ = lazy_exports("megatron", {"ConfigError": "errors", "parse_duration": "megatron.time_phrases",
                                         "Nope": "errors"})
    from megatron.errors import ConfigError
    from megatron.time_phrases import parse_duration

    assert getattr_("ConfigError") is ConfigError  # a module of the package
    assert getattr_("parse_duration") is parse_duration  # a full dotted name
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        getattr_("missing")
    with pytest.raises(AttributeError):
        getattr_("Nope")  # named, but its module does not define it


# --- the reader itself, on a tiny package written here ------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


LAYERED = {
    "toy/__init__.py": "",
    "toy/low.py": "import os\n",
    "toy/mid.py": "from toy.low import os\nfrom . import low\n",
    "toy/high.py": "import toy.mid\nfrom toy import low\n",
}


def test_layered_package_has_no_cycles(tmp_path: Path) -> None:
    _write(tmp_path, LAYERED)
    graph = import_graph(tmp_path, "toy")
    assert set(graph.edges) == {("toy.mid", "toy.low"), ("toy.high", "toy.mid"), ("toy.high", "toy.low")}
    assert cycles(graph) == []


@pytest.mark.parametrize(
    "back_edge",
    [
        "from toy.high import thing\n",  # module level
        "def f():\n    from toy import high\n",  # lazy, inside a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..toy.high import T\n",  # relative, typing only
        "import importlib\nimportlib.import_module('toy.high')\n",  # by name
        "from toy.lazy import thing\n",  # through a PEP 562 export
        "BUILTIN = {'family': ('toy.high',)}\n",  # a table of modules some other code imports by name
        "TARGET = 'toy.high:thing'\n",  # a registry's "module:attribute" target, imported on first use
    ],
    ids=["module_level", "in_function", "type_checking", "import_module", "lazy_export", "module_name", "target"],
)
def test_every_kind_of_import_closes_a_cycle(tmp_path: Path, back_edge: str) -> None:
    files = dict(LAYERED)
    files["toy/low.py"] = back_edge
    files["toy/lazy/__init__.py"] = "_EXPORTS = {'thing': 'impl'}\ndef __getattr__(name):\n    pass\n"
    files["toy/lazy/impl.py"] = "import toy.high\n"
    _write(tmp_path, files)
    found = cycles(import_graph(tmp_path, "toy"))
    assert len(found) == 1
    text = describe(found[0])
    assert "toy.low imports toy." in text and "toy/low.py:" in text, text
    assert {"toy.low", "toy.high"} <= {a for a, _, _ in found[0]}


def test_two_separate_cycles_are_both_named(tmp_path: Path) -> None:
    _write(tmp_path, {"toy/__init__.py": "", "toy/a.py": "import toy.b\n", "toy/b.py": "import toy.a\n",
                      "toy/c.py": "import toy.d\n", "toy/d.py": "def f():\n    import toy.c\n"})
    found = cycles(import_graph(tmp_path, "toy"))
    assert [sorted(a for a, _, _ in c) for c in found] == [["toy.a", "toy.b"], ["toy.c", "toy.d"]]


def test_lazy_package_without_exports_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, {"toy/__init__.py": "def __getattr__(name):\n    pass\n"})
    with pytest.raises(AssertionError, match="_EXPORTS"):
        import_graph(tmp_path, "toy")


def test_an_import_up_the_layers_is_named(tmp_path: Path) -> None:
    _write(tmp_path, {"toy/__init__.py": "", "toy/low/__init__.py": "", "toy/high/__init__.py": "",
                      "toy/high/a.py": "import toy.low.b\n", "toy/low/b.py": "", "toy/low/c.py": "from toy.high import a\n"})
    graph = import_graph(tmp_path, "toy")
    assert layering_violations(graph, (("high",), ("low",))) == ["toy/low/c.py:1: toy.low.c (low) imports toy.high.a (high)"]
    assert len(layering_violations(graph, (("high", "low"),))) == 2  # one layer's packages do not import each other


def test_a_string_naming_a_module_up_the_layers_is_named(tmp_path: Path) -> None:
    """A low module that names a higher one in a string (a table of modules imported by name, a ``module:attribute``
    target) depends on it as surely as one that imports it; strings that are not exactly a module's name are not
    imports."""
    _write(tmp_path, {"toy/__init__.py": "", "toy/low/__init__.py": "", "toy/high/__init__.py": "", "toy/high/impl.py": "",
                      "toy/low/table.py": ("import logging\n"
                                           "BUILTIN = {'family': ('toy.high.impl',)}\n"
                                           "TARGET = 'toy.high.impl:Thing'\n"
                                           "log = logging.getLogger('toy')\n"  # the package's bare name: a logger
                                           "NOT_MODULES = ('toy.high.absent', 'see toy.high.impl', 'toy.high.impl:x y')\n")})
    graph = import_graph(tmp_path, "toy")
    assert set(graph.edges) == {("toy.low.table", "toy.high.impl")}
    assert layering_violations(graph, (("high",), ("low",))) == [
        "toy/low/table.py:2: toy.low.table (low) imports toy.high.impl (high)"]


def test_a_component_importing_the_argument_layer_is_named(tmp_path: Path) -> None:
    _write(tmp_path, {"toy/__init__.py": "", "toy/neox_arguments/__init__.py": "", "toy/neox_arguments/load.py": "",
                      "toy/app/__init__.py": "", "toy/app/main.py": "from toy.neox_arguments import load\n",
                      "toy/training/__init__.py": "",
                      "toy/training/run.py": "def f():\n    from toy.neox_arguments.load import x\n"})
    graph = import_graph(tmp_path, "toy")
    assert argument_layer_importers(graph, "toy") == ["toy/training/run.py:2"]  # the app may; a component may not
