"""Where the documents of ``eval_tasks`` come from, decided before launch without the network.

lm-evaluation-harness (0.4.13) turns a task into ``datasets.load_dataset(path=dataset_path, name=dataset_name,
**dataset_kwargs)`` (``lm_eval/api/task.py:855-873``, ``ConfigurableTask.download``). What that call needs, read
from Hugging Face ``datasets`` (5.2.0, ``datasets/load.py:1047-1170``, ``dataset_module_factory``):

* ``dataset_path`` naming a packaged builder (``json``, ``csv``, ``parquet``, ``arrow``, ``text``, ...; the folders of
  ``datasets/packaged_modules``) reads ``dataset_kwargs.data_files`` (or ``data_dir``): local files, relative to the
  directory the run starts in, or URLs;
* a local directory is read as it is;
* anything else with at most one ``/`` is a dataset on the Hugging Face Hub. Offline, or when the Hub cannot be
  reached, ``datasets`` falls back to a prepared copy in its cache, ``<HF_DATASETS_CACHE>/<namespace>___<name>/``
  holding ``<config>/<version>/<hash>/`` folders (``CachedDatasetModuleFactory``, ``load.py:808-833``); without one
  it fails, after its retries when nothing told it that it is offline.

A task name is resolved to its YAML as the harness indexes them (``lm_eval/tasks/_index.py``, ``TaskIndex``): a file
whose ``task`` is the name, a group (``group``: its ``task`` list, each entry a name or an inline config), or a tag
(every task listing it under ``tag``); ``include`` merges the files it names below the file's own keys
(``lm_eval/tasks/_yaml_loader.py:164-203``, ``load_yaml``). Files are found by a byte search first, so only the few
that mention a name are parsed. Whatever this cannot resolve (a task defined in Python, a ``custom_dataset``) is left
to the harness: these checks only name what certainly cannot be read.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
"""How ``datasets`` and ``huggingface_hub`` read a switch from the environment (``ENV_VARS_TRUE_VALUES``)."""
HUB_ENDPOINT = "https://huggingface.co"
"""``huggingface_hub.constants._HF_DEFAULT_ENDPOINT``; ``HF_ENDPOINT`` replaces it."""
REACH_TIMEOUT_S = 3.0
"""How long the check waits for the Hub's host to answer before calling it unreachable."""
EXAMPLE_TASK = "configs/lm_eval/python_builtins.yaml"
"""The shipped task over a local file (docs/generation.md), named in the messages."""


@dataclass(frozen=True)
class TaskSource:
    """One task's ``datasets.load_dataset`` arguments, as its YAML gives them."""

    task: str
    yaml_path: Path | None
    dataset_path: str
    dataset_name: str | None
    dataset_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Unreadable:
    """A task whose documents this machine cannot read now: ``hub`` (a Hub dataset id or a URL) needs a download,
    ``missing`` lists local files or folders that do not exist."""

    task: str
    hub: str | None = None
    missing: tuple[str, ...] = ()


# ---------------------------------------------------------------- reading task YAML files


_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _loader(folder: Path) -> Any:
    """lm-eval's loader with ``resolve_func=False``: a ``!function`` tag becomes the path of the function beside the
    file (``<folder>/utils.process_docs``), never imported."""

    class Loader(_SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: str(folder / loader.construct_scalar(node)))
    return Loader


def read_task_yaml(path: str | os.PathLike[str], _seen: frozenset[Path] = frozenset()) -> dict[str, Any]:
    """A task file with its ``include`` files merged under its own keys, as ``lm_eval``'s ``load_yaml`` reads it."""
    path = Path(path).expanduser().resolve()
    if path in _seen:
        raise ValueError(f"include cycle at {path}")
    config = yaml.load(path.read_bytes(), Loader=_loader(path.parent))  # noqa: S506 - safe, plus one string tag
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a mapping")
    includes = config.pop("include", None)
    if includes is None:
        return config
    merged: dict[str, Any] = {}
    for name in includes if isinstance(includes, list) else [includes]:
        included = read_task_yaml(path.parent / name, _seen | {path})
        included.pop("task_list", None)
        merged.update(included)
    merged.update(config)
    return merged


def yaml_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for folder, _, names in sorted(os.walk(root)):
        yield from (Path(folder) / name for name in sorted(names) if name.endswith((".yaml", ".yml")))


@lru_cache(maxsize=1)
def harness_task_files() -> tuple[Path, ...]:
    """The task YAML files lm-evaluation-harness indexes (empty when it is not installed)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return ()
    return tuple(yaml_files(Path(spec.origin).parent / "tasks"))


@lru_cache(maxsize=16384)
def file_bytes(path: Path) -> bytes:
    """A task file's bytes, read once per process (empty when unreadable)."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


class TaskFiles:
    """Task names resolved to task configs over ``files`` (the user's first, then the harness' own)."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.files = list(files)

    def _mentioning(self, name: str) -> Iterator[tuple[Path, dict[str, Any]]]:
        raw = name.encode()
        token = re.compile(rb"(?<![\w.-])" + re.escape(raw) + rb"(?![\w.-])")
        for path in self.files:
            data = file_bytes(path)
            if raw in data and token.search(data):
                try:
                    yield path, read_task_yaml(path)
                except Exception:  # noqa: BLE001 - the harness skips files it cannot read, and so do we
                    continue

    def sources(self, name: str, _seen: frozenset[str] = frozenset()) -> list[TaskSource] | None:
        """The tasks ``name`` stands for (a task, a group's tasks, a tag's tasks); None when it cannot be told."""
        if name in _seen:
            return []
        found: list[TaskSource] = []
        tagged = False
        for path, config in self._mentioning(name):
            if config.get("task") == name or config.get("group") == name:
                return self.config_sources(config, path, _seen | {name})
            if name in _as_list(config.get("tag")) and "task" in config:
                tagged = True
                found.extend(self.config_sources(config, path, _seen | {name}) or [])
        return found if tagged else None

    def config_sources(self, config: dict[str, Any], path: Path | None,
                       seen: frozenset[str]) -> list[TaskSource] | None:
        """The tasks one task file's config stands for (None when they cannot be told)."""
        if "class" in config or config.get("custom_dataset"):
            return None  # a task defined in Python: its data are its own business
        if "group" in config:
            members: list[TaskSource] = []
            for entry in _as_list(config.get("task")):
                if isinstance(entry, str):
                    inner = self.sources(entry, seen)
                elif isinstance(entry, dict):
                    inner = self._inline(entry, path, seen)
                else:
                    inner = None
                if inner is None:
                    return None
                members.extend(inner)
            return members
        name, source = config.get("task"), config.get("dataset_path")
        if not isinstance(name, str) or not isinstance(source, str):
            return None
        kwargs = config.get("dataset_kwargs")
        name_of_config = config.get("dataset_name")
        return [TaskSource(name, path, source, name_of_config if isinstance(name_of_config, str) else None,
                           kwargs if isinstance(kwargs, dict) else {})]

    def _inline(self, entry: dict[str, Any], path: Path | None, seen: frozenset[str]) -> list[TaskSource] | None:
        """A group's dict entry: a task config of its own, or a known task's name with overrides."""
        name = entry.get("task")
        if "dataset_path" in entry or not isinstance(name, str):
            return self.config_sources(entry, path, seen)
        base = next((c for p, c in self._mentioning(name) if c.get("task") == name and "group" not in c), None)
        return None if base is None else self.config_sources({**base, **entry}, path, seen)


def task_sources(tasks: Iterable[str], harness_files: Iterable[Path] | None = None) -> list[TaskSource] | None:
    """The tasks ``eval_tasks`` runs, with where each reads its documents; None when any entry cannot be told."""
    entries = list(tasks)
    local = [Path(t) for t in entries if Path(t).exists()]  # the harness indexes a task file's whole folder
    user_files = [f for p in local for f in yaml_files(p if p.is_dir() else p.parent)]
    index = TaskFiles([*user_files, *(harness_task_files() if harness_files is None else harness_files)])
    found: list[TaskSource] = []
    for entry in entries:
        path = Path(entry)
        if path.is_file():
            try:
                sources = index.config_sources(read_task_yaml(path), path, frozenset())
            except Exception:  # noqa: BLE001 - a broken file is the harness' to name, on the ranks
                return None
        elif path.is_dir():
            sources = []
            for file in yaml_files(path):
                try:
                    config = read_task_yaml(file)
                except Exception:  # noqa: BLE001
                    return None
                inner = index.config_sources(config, file, frozenset()) if "task" in config or "group" in config else []
                if inner is None:
                    return None
                sources.extend(inner)
        else:
            sources = index.sources(entry)
        if sources is None:
            return None
        found.extend(sources)
    return found


# ---------------------------------------------------------------- is the data here?


@lru_cache(maxsize=1)
def packaged_builders() -> frozenset[str]:
    """The names ``datasets`` serves from its own code (``json``, ``csv``, ...): its ``packaged_modules`` folders."""
    spec = importlib.util.find_spec("datasets")
    if spec is None or spec.origin is None:
        return frozenset({"json", "csv", "parquet", "arrow", "text", "pandas"})
    root = Path(spec.origin).parent / "packaged_modules"
    return frozenset(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_"))


def datasets_cache(cache_dir: str | None = None) -> Path:
    """``datasets.config.HF_DATASETS_CACHE`` for this environment (or the task's ``cache_dir``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    return Path(os.environ.get("HF_DATASETS_CACHE", os.path.join(os.path.expanduser(home), "datasets"))).expanduser()


def _snake(name: str) -> str:
    """``datasets.naming.camelcase_to_snakecase``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def hub_cached(dataset: str, cache_dir: str | None = None) -> bool:
    """``datasets``' own test for a prepared copy of Hub dataset ``dataset`` it can read offline."""
    parts = dataset.split("/")
    parts[-1] = _snake(parts[-1])
    root = datasets_cache(cache_dir) / "___".join(parts)
    return any(os.path.isdir(p) for p in glob.glob(os.path.join(glob.escape(str(root)), "*", "*", "*")))


def hub_snapshot(dataset: str) -> bool:
    """A download of Hub dataset ``dataset`` in ``huggingface_hub``'s cache (``<HF_HUB_CACHE>/datasets--org--name``,
    e.g. from ``hf download --repo-type dataset``): ``datasets`` reads it when the Hub does not answer, not when
    told it is offline (it raises before looking, ``load.py:1104-1124``)."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    snapshots = Path(os.path.expanduser(hub)) / f"datasets--{dataset.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _data_files(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [f for v in value.values() for f in _data_files(v)]
    return [str(v) for v in _as_list(value)]


def unreadable(source: TaskSource) -> Unreadable | None:
    """Why ``source``'s documents cannot be read on this machine without a download (None: they can, or this
    cannot tell)."""
    path, kwargs = source.dataset_path, source.dataset_kwargs
    if path.startswith("hf://"):
        return Unreadable(source.task, hub=path)
    if path in packaged_builders():
        files = _data_files(kwargs.get("data_files"))
        remote = [f for f in files if "://" in f]
        if remote:
            return Unreadable(source.task, hub=remote[0])
        missing = [f for f in files if not glob.glob(os.path.expanduser(f))]
        data_dir = kwargs.get("data_dir")
        if isinstance(data_dir, str) and "://" not in data_dir and not os.path.isdir(os.path.expanduser(data_dir)):
            missing.append(data_dir)
        return Unreadable(source.task, missing=tuple(missing)) if missing else None
    if os.path.isdir(os.path.expanduser(path)):
        return None
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:
        return Unreadable(source.task, missing=(path,))  # not a Hub id: datasets looks for it on disk
    cache = kwargs.get("cache_dir")
    if hub_cached(path, cache if isinstance(cache, str) else None) or (offline_switch() is None and hub_snapshot(path)):
        return None
    return Unreadable(source.task, hub=path)


def offline_switch() -> str | None:
    """The variable that tells ``datasets`` it is offline, as ``datasets.config`` reads them, e.g.
    ``HF_HUB_OFFLINE=1``; None when none does."""
    own = os.environ.get("HF_DATASETS_OFFLINE")
    if own is not None:  # datasets reads its own switch first, and only it when set
        return f"HF_DATASETS_OFFLINE={own}" if own.upper() in TRUE_VALUES else None
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:
            return f"{name}={value}" if value.upper() in TRUE_VALUES else None
    return None


def hub_unreachable(timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be reached from here (its host, or the proxy's, does not accept a connection within
    ``timeout_s``); None when it can."""
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(v)),
                 None)
    url = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else
                   os.environ.get("HF_ENDPOINT", HUB_ENDPOINT))
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = ["no answer within {:.0f} s".format(timeout_s)]

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome[0] = None
        except OSError as err:
            outcome[0] = str(err) or type(err).__name__

    probe = threading.Thread(target=connect, name="deepy-hub-probe", daemon=True)  # name lookups ignore timeouts
    probe.start()
    probe.join(timeout_s + 0.5)
    if outcome[0] is None:
        return None
    return f"{'the proxy ' if proxy else ''}{host}:{port} cannot be reached ({outcome[0]})"
