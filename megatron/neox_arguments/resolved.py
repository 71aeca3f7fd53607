"""The resolved config: validated arguments plus where each value came from, and its file form.

``deepy.py`` resolves the config once, writes it to ``<run_dir>/deepy_config.json`` and hands every
rank that path (``train.py --deepy_config PATH``), so no rank re-reads YAML, no blob of arguments shows
up in ``ps`` and the run directory documents exactly what ran.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from megatron.atomic_files import atomic_write_text
from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import schema_class
from megatron.plugins import load_user_plugins

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

FORMAT_NAME = "deepy-resolved-config"
FORMAT_VERSION = 1
RESOLVED_FILE_NAME = "deepy_config.json"
DEFAULT_RUNS_DIR = "runs"


@dataclass
class ResolvedConfig:
    """Everything a rank needs to know about the run, and where each value came from: the arguments
    themselves (every key, declared by its component's group) and what the launch worked out around
    them; no key is copied here."""

    args: NeoXArgs
    provenance: dict[str, str] = field(default_factory=dict)
    """key -> ``"configs/125M.yml:12"`` | ``"cli"`` | ``"derived"``; a missing key kept its default."""
    deepspeed_config: dict[str, Any] | None = None
    """The DeepSpeed config dict, once :func:`finalize` has split it off."""
    directory: str | None = None
    """Directory of this launch, where this file is written: the ``run_dir`` key when set, else the run's
    own directory ``<log_dir>/<run name>`` (:func:`run_directory`), which also holds its metrics.jsonl;
    chosen once by ``deepy.py`` just before writing."""
    run_name: str | None = None
    """The run's name when deepy.py chose the directory (a new run's fresh name, or the name a resumed
    run's checkpoint records): the ranks name the run so, and its metrics go to the same directory."""
    warnings: list[str] = field(default_factory=list)
    """Said before launching (a hostfile that does not exist, files not visible from here, ...)."""
    skipped: list[str] = field(default_factory=list)
    """Checks not made before launch, and why (``--dry-run`` lists them)."""
    dialect: dict[str, Any] | None = None
    """For a Levanter or fms-fsdp config: ``{"name": ..., "rows": [{key, where, neox}, ...]}``, each
    dialect key and the GPT-NeoX keys it became (``args`` holds the result, whatever the dialect)."""
    entry_point: str | None = None
    """The script the ranks will run (``train.py``, ``generate.py``, ...), set by ``deepy.py`` before the checks:
    what a run starts from is checked as that script will load it. Not stored: the ranks know their script."""

    @property
    def config_files(self) -> dict[str, str]:
        """path as given -> original text of every config file read (includes too): the loader keeps
        them in the ``config_files`` key (they are stored with checkpoints); empty for a mapping."""
        return dict(self.args.config_files or {})

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "args": self.args.model_dump(mode="json"),
            "provenance": dict(sorted(self.provenance.items())),
            "deepspeed_config": self.deepspeed_config,
            "run_dir": self.directory,
            "run_name": self.run_name,
            "dialect": self.dialect,
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON file atomically: a reader sees the old file or the whole new one."""
        target = Path(path)
        atomic_write_text(target, json.dumps(self.to_json_dict(), indent=2, sort_keys=False) + "\n")
        return target


def load_resolved(path: str | os.PathLike[str]) -> ResolvedConfig:
    """Read a file written by :meth:`ResolvedConfig.write` (what each rank does at start-up)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"resolved config not found: {path}; it is written by deepy.py") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read resolved config {path}: {err}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ConfigError(f"{path} is not a resolved config written by deepy.py")
    if data.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path} has resolved-config version {data.get('version')!r}, this Deepy reads version "
            f"{FORMAT_VERSION}; run deepy.py again to rewrite it"
        )
    stored = data.get("args") or {}
    load_user_plugins(stored.get("plugins") or [], where=str(path))
    schema = schema_class()
    try:
        args = schema.model_validate(_changed_only(schema, stored))
    except ValidationError as err:
        raise ConfigError(f"{path}: the stored arguments no longer match the schema: {err}") from err
    return ResolvedConfig(
        args=args,
        provenance=dict(data.get("provenance") or {}),
        deepspeed_config=data.get("deepspeed_config"),
        directory=data.get("run_dir"),
        run_name=data.get("run_name"),
        dialect=data.get("dialect"),
    )


def _changed_only(schema: type[NeoXArgs], stored: dict[str, Any]) -> dict[str, Any]:
    """The stored values that differ from the defaults.

    pydantic does not validate defaults, so a default that does not fit its own annotation (``None``
    for a ``str``) is fine in a fresh object but would fail validation when read back.
    """
    changed: dict[str, Any] = {}
    for key, value in stored.items():
        field_info = schema.model_fields.get(key)
        if field_info is not None:
            default = field_info.get_default(call_default_factory=True)
            if value == default or (isinstance(default, tuple) and value == list(default)):
                continue
        changed[key] = value
    return changed


def default_run_dir(log_dir: str | None, now: datetime | None = None) -> Path:
    """``<log_dir or "runs">/<YYYYmmdd-HHMMSS>``: a fresh directory per launch, sortable by time."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(log_dir or DEFAULT_RUNS_DIR) / stamp


def run_directory(args: NeoXArgs, now: datetime | None = None, run_name: str | None = None) -> Path:
    """Where this launch's resolved config goes: ``run_dir`` if set, else the run's own directory
    ``<log_dir or runs>/<run_name>`` (the one its metrics.jsonl is written to), else a fresh timestamped
    directory under ``log_dir`` (or ``runs``)."""
    if args.run_dir:
        return Path(args.run_dir)
    if run_name:
        return Path(args.log_dir or DEFAULT_RUNS_DIR) / run_name
    return default_run_dir(args.log_dir, now)
