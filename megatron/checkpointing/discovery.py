"""What a ``load`` directory holds, and what to tell the user when it is not a Deepy checkpoint.

Loading is explicit: a run given ``load`` resumes from a committed Deepy checkpoint there, or stops
with a message naming what it found instead. Starting fresh is something the user asks for
(``load_checkpoint: false`` or no ``load``), with one exception: ``load`` equal to ``save`` and
still missing or empty is the first run of a resumable setup.

Only the file system is looked at (names and markers, no tensors), so every rank reaches the same
verdict without communicating.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron.checkpointing import commit
from megatron.launcher.requeue import LEDGER_FILE
from megatron.launcher.save_lock import LOCK_NAME

FoundKind = Literal["missing", "empty", "deepy", "deepy_tag", "incomplete", "gpt_neox", "hf_model", "other"]

META_FILE = "deepy_meta.json"
DEEPSPEED_MODEL_FILE = re.compile(r"^(mp_rank_\d+_model_states\.pt|layer_\d+-model_\d+-model_states\.pt)$")
# files DeepSpeed drops into every save directory, and the folder deepy.py converts initialize_from_hf into
# (interop/hf_start.py's IMPORT_DIR, inside save), and a Slurm job's requeue record (launcher/requeue.py); on their
# own they are not a checkpoint of the run's
_HELPERS = {"zero_to_fp32.py", "zero_to_torch.py", commit.LATEST_FILE, "latest_universal", "hf_import", LEDGER_FILE}
IMPORT_TOOL = "tools/ckpts/convert_hf_to_neox.py"


@dataclass(frozen=True)
class Found:
    kind: FoundKind
    path: Path
    committed: list[int] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    foreign_tag: Path | None = None
    """The GPT-NeoX checkpoint (``global_stepN``) a GPT-NeoX save directory would load."""
    entries: list[str] = field(default_factory=list)


def is_deepspeed_dir_without_meta(path: Path) -> bool:
    """DeepSpeed model files but no Deepy metadata: a GPT-NeoX (DeeperSpeed) checkpoint."""
    if not path.is_dir() or (path / META_FILE).exists():
        return False
    return any(DEEPSPEED_MODEL_FILE.match(p.name) for p in path.iterdir())


def find_gpt_neox_tag(path: Path) -> Path | None:
    """The checkpoint GPT-NeoX would load from ``path``: itself, the tag ``latest`` names, or the newest tag."""
    if is_deepspeed_dir_without_meta(path):
        return path
    latest = path / commit.LATEST_FILE
    if latest.is_file():
        named = path / latest.read_text(encoding="utf-8").strip()
        if is_deepspeed_dir_without_meta(named):
            return named
    tags = sorted((step, p) for p in path.iterdir() if (step := commit.step_of(p.name)) is not None)
    for _, tag in reversed(tags):
        if is_deepspeed_dir_without_meta(tag):
            return tag
    return None


def inspect_load_dir(path: Path) -> Found:
    if not path.exists():
        return Found("missing", path)
    if not path.is_dir():
        return Found("other", path, entries=[path.name])
    if (path / META_FILE).is_file():
        return Found("deepy_tag", path)
    listing = commit.list_checkpoints(path)
    if listing.committed:
        return Found("deepy", path, committed=listing.steps, incomplete=listing.incomplete)
    neox = find_gpt_neox_tag(path)
    if neox is not None:
        return Found("gpt_neox", path, foreign_tag=neox)
    weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    if (path / "config.json").is_file() and weights:
        return Found("hf_model", path)
    if listing.incomplete:
        return Found("incomplete", path, incomplete=listing.incomplete)
    # deepy.py's lock (megatron/launcher/save_lock.py) is taken before the ranks look at an empty save directory
    entries = sorted(p.name for p in path.iterdir() if p.name not in _HELPERS and not p.name.startswith(LOCK_NAME))
    if not entries:
        return Found("empty", path)
    return Found("other", path, entries=entries)


def resume_point(load_dir: Path, iteration: int | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resume from ``load_dir`` would load (``iteration``'s, else the newest
    committed one) and its ``deepy_meta.json``; None when there is none to resume from or its
    metadata is unreadable (the run itself then explains why)."""
    if inspect_load_dir(load_dir).kind != "deepy":
        return None
    if iteration is not None:
        tag: str | None = commit.tag_for(iteration) if commit.is_committed(load_dir / commit.tag_for(iteration)) else None
    else:
        tag, _ = commit.newest_committed(load_dir)
    if tag is None:
        return None
    try:
        meta = json.loads((load_dir / tag / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (load_dir / tag, meta) if isinstance(meta, dict) else None


def _same_path(a: Any, b: Any) -> bool:
    if not a or not b:
        return not a and not b
    return Path(str(a)).resolve() == Path(str(b)).resolve()


def run_in_save(save_dir: Path, *, load: str | None, initialize_from: str | None,
                finetune: bool) -> tuple[str, dict[str, Any]] | None:
    """The newest committed checkpoint in ``save_dir`` and the arguments it recorded; None when there is none.
    A checkpoint belongs to this run (a restart) when :func:`same_source` says so."""
    tag, _ = commit.newest_committed(save_dir) if save_dir.is_dir() else (None, [])
    if tag is None:
        return None
    try:
        meta = json.loads((save_dir / tag / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    recorded = meta.get("args") if isinstance(meta, dict) else None
    return tag, recorded if isinstance(recorded, dict) else {}


def same_source(recorded: dict[str, Any], *, load: str | None, initialize_from: str | None, finetune: bool) -> bool:
    """Whether a run that recorded ``recorded`` started from the same place as this one: the same ``load``,
    ``initialize_from`` and ``finetune`` (a restart of the same config writes on where it stopped)."""
    # `load` counts only where it was read: `load_checkpoint: false` ignores it
    recorded_load = recorded.get("load") if recorded.get("load_checkpoint", True) else None
    return (_same_path(recorded_load, load) and _same_path(recorded.get("initialize_from"), initialize_from)
            and bool(recorded.get("finetune")) == bool(finetune))


def foreign_run_message(save_dir: Path, tag: str, recorded: dict[str, Any], this_run: str,
                        shown: str | None = None) -> str:
    """Why a run refuses a ``save`` directory that holds another run's checkpoints (``shown``: how the message
    names the setting)."""
    started = ", ".join(f"{key}={recorded[key]}" for key in ("load", "initialize_from", "finetune") if recorded.get(key))
    return (f"{shown or f'save: {save_dir}'} already holds {tag} of another run (which started from "
            f"{started or 'scratch'}), and this run {this_run}: its checkpoints would be mixed with that run's "
            f"(and replace those of the same steps). Save to another directory, or remove them.")


def _fresh_start_hint() -> str:
    return "set load_checkpoint: false (or remove load) to start fresh instead"


def explain(found: Found, tp: int, pp: int, key: str = "load", shown: str | None = None) -> str:
    """The error message for a ``load`` (or ``initialize_from``) that holds no committed Deepy checkpoint;
    ``shown``: how the message names the setting (``key=value (file:line)`` before launch)."""
    where = shown or f"{key}: {found.path}"
    if found.kind == "missing":
        return f"{where} does not exist, so there is nothing to resume from; fix the path, or {_fresh_start_hint()}"
    if found.kind == "empty":
        return f"{where} is empty, so there is nothing to resume from; fix the path, or {_fresh_start_hint()}"
    if found.kind == "deepy_tag":
        step = commit.step_of(found.path.name)
        pick = f" and iteration: {step}" if step is not None else ""
        return (f"{where} is one checkpoint, not a save directory: set {key}: {found.path.parent}{pick} "
                f"({key} names the directory that holds the global_stepN checkpoints)")  # fmt: skip
    if found.kind == "gpt_neox":
        assert found.foreign_tag is not None
        out = f"{found.path.resolve()}_deepy"
        return (
            f"{where} is a GPT-NeoX (DeeperSpeed) checkpoint ({found.foreign_tag.name}: DeepSpeed model files, no "
            f"{META_FILE}), which Deepy does not load directly. Convert it once:\n"
            f"  python {IMPORT_TOOL} {found.foreign_tag} {out} --tp {tp} --pp {pp}\n"
            f"then set {key}: {out} (the converter also writes {out}/deepy_model.yml with the matching model keys)"
        )
    if found.kind == "hf_model":
        out = f"{found.path.resolve()}_deepy"
        return (
            f"{where} is a Hugging Face model directory, which Deepy does not load directly. Convert it once:\n"
            f"  python {IMPORT_TOOL} {found.path} {out} --tp {tp} --pp {pp}\n"
            f"then fine-tune from {key}: {out} (see {out}/deepy_model.yml)"
        )
    if found.kind == "incomplete":
        names = ", ".join(found.incomplete)
        return (
            f"{where} holds no committed checkpoint: {names} {'is' if len(found.incomplete) == 1 else 'are'} "
            f"incomplete (no {commit.COMMIT_MARKER} marker: the save was interrupted) and there is no earlier "
            f"committed one to fall back to. Remove {'it' if len(found.incomplete) == 1 else 'them'}, or "
            f"{_fresh_start_hint()}"
        )
    shown = ", ".join(found.entries[:8]) + (", ..." if len(found.entries) > 8 else "")
    return (
        f"{where} holds no Deepy checkpoint (found: {shown}); a Deepy save directory contains global_stepN/ "
        f"checkpoints with a {commit.COMMIT_MARKER} marker. Fix the path, or {_fresh_start_hint()}"
    )


OPTIMIZER_SAVED_KEY = "optimizer_saved"
"""``deepy_meta.json``: false when the checkpoint was written with ``no_save_optim`` (no optimizer or LR-scheduler
state); missing (older checkpoints) means true."""


def unsaved_optimizer_problem(meta: dict[str, Any], layout_changes: bool, weights_only: bool,
                              load_optim: bool) -> str | None:
    """Why a checkpoint written with ``no_save_optim`` cannot be loaded this way; None when it can (or it holds the
    optimizer state): its weights start a run (``finetune``/``initialize_from``) or a resume with a fresh optimizer
    (``no_load_optim``) at its layout, but an exact resume needs the optimizer and LR-scheduler state it lacks, and a
    layout change reads the ZeRO files (the fp32 masters) it lacks."""
    if meta.get(OPTIMIZER_SAVED_KEY, True):
        return None
    if layout_changes:
        return ("it was saved with no_save_optim: true, without the optimizer files a change of parallel layout "
                "is read from; load it at its own layout")
    if not weights_only and load_optim:
        return ("it was saved with no_save_optim: true (no optimizer or LR-scheduler state), so it cannot be resumed "
                "exactly: start from its weights with finetune: true (or initialize_from), or resume it with "
                "no_load_optim: true (a fresh optimizer at its step)")
    return None
