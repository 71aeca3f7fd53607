"""What every dialect shares: located leaves, translation rules, and the record of what became what.

A dialect config (a Levanter YAML tree, fms-fsdp's flat keys) is first flattened into *leaves*:
``trainer.num_train_steps = 10`` with the ``file:line`` or command-line flag it came from. Each leaf
is then handed to its rule, which returns the GPT-NeoX keys it means (``{"train_iters": 10}``) or
refuses it with a reason. The result is a plain GPT-NeoX value dict plus provenance, so everything
after this layer (types, rules, derived values, the DeepSpeed split) is the one GPT-NeoX path.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron import object_store
from megatron.errors import ConfigError
from megatron.neox_arguments.yaml_source import LocatedDict
from megatron.object_store import scheme_of

LAUNCH_KEYS = frozenset({"num_gpus", "num_nodes", "hostfile", "launcher", "master_port"})
"""GPT-NeoX keys that only say where the ranks run; they may accompany any dialect (how a CPU run,
or a run on fewer GPUs than the node has, says how many ranks)."""

REMOTE_PREFIXES = ("gs://", "s3://", "hf://", "http://", "https://", "az://", "abfs://")
DOWNLOADS = ("hf://", "http://", "https://")
"""Remote URLs that would download a dataset or a model: refused (give local paths)."""

OBJECT_STORE_LEAVES: dict[str, bool] = {
    # Levanter: checkpoints, HF and PEFT saves, raw-text shards
    "trainer.checkpointer.base_path": True, "trainer.load_checkpoint_path": False, "trainer.initialize_from": False,
    "hf_save_path": True, "merged_hf_save_path": True, "peft_save_path": True,
    "data.train_urls": False, "data.validation_urls": False,
    # fms-fsdp: checkpoints and token shards
    "ckpt_save_path": True, "ckpt_load_path": False, "data_path": False,
}
"""Dialect keys whose paths may be in object storage (``megatron/object_store.py``), and whether the run writes
there; their buckets are probed before launch by the keys they become (``save``, ``load``, ``data_path``, ...)."""


def _unusable_store(dialect: str, path: str, leaf: Leaf, urls: list[str]) -> str | None:
    for url in urls:
        try:
            object_store.check_url(path, url, write=OBJECT_STORE_LEAVES[path], probe=False)
        except object_store.StoreError as err:
            reason = err.message.partition(": ")[2]  # without check_url's own naming of the key
            return f"{dialect} key {path} at {leaf.where}: {reason if reason.startswith(url) else f'{url}: {reason}'}"
    return None


@dataclass(frozen=True)
class Leaf:
    """One dialect key as the user wrote it."""

    path: str
    """Dotted key in the dialect (``trainer.checkpointer.base_path``; fms-fsdp keys have no dots)."""
    value: Any
    where: str
    """``file:line`` or ``--flag`` (command line)."""


class Refused(Exception):
    """Raised by a rule: the key has no meaning in Deepy (the message says why and what to use)."""


@dataclass(frozen=True)
class Context:
    """What a rule may look at besides its own value: every other leaf of the same config."""

    leaves: Mapping[str, Leaf]

    def value(self, path: str, default: Any = None) -> Any:
        leaf = self.leaves.get(path)
        return default if leaf is None else leaf.value


Rule = Callable[[Any, Context], dict[str, Any]]
"""A dialect value (and its context) -> the GPT-NeoX keys and values it means."""


def to(*names: str) -> Rule:
    """The value as it is, under each of ``names`` (a rename)."""
    return lambda value, ctx: {name: value for name in names}


NOTE = "__note__"
"""A rule's result may carry, under this name, why the key sets nothing here (``--dry-run`` shows it)."""


def noted(reason: str) -> dict[str, Any]:
    """A rule's result for a key accepted at a value that is what Deepy does anyway (a kernel's block
    size, JAX's layer scan): nothing to set, and the reason."""
    return {NOTE: reason}


@dataclass(frozen=True)
class Row:
    """One line of the dry-run's dialect table: a dialect key and the GPT-NeoX key(s) it became."""

    key: str
    where: str
    neox: dict[str, Any]
    note: str = ""
    """Why the key sets nothing (or nothing more): what Deepy does is already what it means."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "where": self.where, "neox": self.neox, **({"note": self.note} if self.note else {})}


@dataclass(frozen=True)
class PrepareStep:
    """A command of Deepy's own tools that deepy.py runs before launch, once: while ``creates`` is missing."""

    argv: tuple[str, ...]
    """The tool and its arguments, the tool's path relative to the repository (``tools/datasets/...``)."""
    creates: str
    """The file written last; present means done."""
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "creates": self.creates, "why": self.why}


@dataclass
class Translation:
    """A dialect config turned into GPT-NeoX values, with the record of what became what."""

    dialect: str
    values: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    """GPT-NeoX key -> the dialect key that set it (to name both in a conflict)."""
    prepare: list[PrepareStep] = field(default_factory=list)
    """What deepy.py runs once before launch for this config (a data conversion the dialect's data need)."""

    def record(self) -> dict[str, Any]:
        """What the resolved config keeps of the translation (shown by ``--dry-run``)."""
        out: dict[str, Any] = {"name": self.dialect, "rows": [row.to_json() for row in self.rows]}
        if self.prepare:
            out["prepare"] = [step.to_json() for step in self.prepare]
        return out

    def put(self, leaf: Leaf, neox: dict[str, Any], *, implied: bool = False) -> None:
        """Record ``leaf`` -> ``neox``. An implied value (a model type's preset, a dialect default)
        gives way to an explicit one; two explicit keys setting one GPT-NeoX key differently are an
        error naming both."""
        kept: dict[str, Any] = {}
        neox = dict(neox)
        note = str(neox.pop(NOTE, ""))
        for name, value in neox.items():
            previous = self.owner.get(name)
            if previous is not None and name in self.values:
                if implied:
                    continue
                if not self.provenance[name].endswith("(implied)") and self.values[name] != value:
                    raise ConfigError(
                        f"{leaf.path} at {leaf.where} and {previous} both set {name} "
                        f"({value!r} and {self.values[name]!r}); keep one of them"
                    )
            self.values[name] = value
            self.provenance[name] = f"{leaf.where} ({self.dialect} {leaf.path}{' (implied)' if implied else ''})"
            self.owner[name] = f"{leaf.path} at {leaf.where}"
            kept[name] = value
        self.rows.append(Row(leaf.path + (" (implied)" if implied else ""), leaf.where, kept, note))


def flatten(data: Any, prefix: str, where: str, leaves: dict[str, Leaf], keep_whole: frozenset[str]) -> None:
    """Nested mappings -> dotted leaves with their lines; lists and ``keep_whole`` paths stay whole."""
    if isinstance(data, dict) and prefix not in keep_whole:
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            spot = data.where(key) if isinstance(data, LocatedDict) else where
            flatten(value, path, spot, leaves, keep_whole)
        if not data and prefix:
            leaves[prefix] = Leaf(prefix, {}, where)
        return
    leaves[prefix] = Leaf(prefix, _plain(data), where)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def remote_urls(value: Any) -> list[str]:
    """Every string inside ``value`` that names a remote store (nothing is downloaded here)."""
    if isinstance(value, str):
        return [value] if value.startswith(REMOTE_PREFIXES) or scheme_of(value) is not None else []
    if isinstance(value, dict):
        return [url for item in value.values() for url in remote_urls(item)]
    if isinstance(value, list):
        return [url for item in value for url in remote_urls(item)]
    return []


def translate_leaves(
    dialect: str,
    leaves: Mapping[str, Leaf],
    rules: Mapping[str, Rule],
    refused: Mapping[str, str],
    translation: Translation,
    keep_whole: frozenset[str] = frozenset(),
) -> None:
    """Apply each leaf's rule; every refusal and unknown key is collected into one error. A flag naming
    one entry of a mapping read whole (``--trainer.jax_config.x v``) is handed to that mapping's rule."""
    leaves = _gather_whole(leaves, keep_whole)
    ctx = Context(leaves)
    problems: list[str] = []
    for path, leaf in leaves.items():
        urls = remote_urls(leaf.value)
        downloads = [url for url in urls if url.startswith(DOWNLOADS)]
        if urls and path in OBJECT_STORE_LEAVES and not downloads:
            problem = _unusable_store(dialect, path, leaf, urls)
            if problem is not None:
                problems.append(problem)
                continue
        elif urls and not downloads:  # a bucket where this key means a directory of this machine
            stored = ", ".join(key for key in OBJECT_STORE_LEAVES if key in rules)
            problems.append(
                f"{dialect} key {path} at {leaf.where}: {urls[0]} is in object storage; Deepy reads {path} on this "
                f"machine - give a local path (of the {dialect} keys, {stored} may name a bucket)"
            )
            continue
        elif urls:
            problems.append(
                f"{dialect} key {path} at {leaf.where}: {downloads[0]} is a remote URL; Deepy reads local paths "
                f"only and downloads nothing - copy the files to this machine and give their path"
            )
            continue
        reason = _refusal(path, refused)
        if reason is not None:
            problems.append(f"{dialect} key {path} at {leaf.where} has no meaning in Deepy: {reason}")
            continue
        rule = rules.get(path)
        if rule is None:
            close = difflib.get_close_matches(path, list(rules), n=3, cutoff=0.6)
            hint = f"; did you mean: {', '.join(close)}?" if close else "; see docs/dialects.md for the keys Deepy reads"
            problems.append(f"unknown {dialect} key {path} at {leaf.where}{hint}")
            continue
        try:
            translation.put(leaf, rule(leaf.value, ctx))
        except Refused as err:
            problems.append(f"{dialect} key {path} = {leaf.value!r} at {leaf.where}: {err}")
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        raise ConfigError(f"{len(problems)} problems in the {dialect} config:\n" + "\n".join(f"  - {p}" for p in problems))


def _gather_whole(leaves: Mapping[str, Leaf], keep_whole: frozenset[str]) -> dict[str, Leaf]:
    out: dict[str, Leaf] = {}
    for path, leaf in leaves.items():
        whole = next((w for w in keep_whole if path.startswith(w + ".")), None)
        if whole is None:
            out[path] = leaf
            continue
        held = out.get(whole)
        value = dict(held.value) if held is not None and isinstance(held.value, dict) else {}
        value[path[len(whole) + 1:]] = leaf.value
        out[whole] = Leaf(whole, value, leaf.where)
    return out


def _refusal(path: str, refused: Mapping[str, str]) -> str | None:
    """The reason ``path`` (or a section it is under, ``trainer.ray`` for ``trainer.ray.address``)
    is refused."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        reason = refused.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None
