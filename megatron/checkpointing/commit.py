"""Making a checkpoint visible only once it is complete.

A save directory looks like::

    <save>/global_step100/          DeepSpeed's files, deepy_meta.json, configs/, COMMITTED
    <save>/global_step100_universal/ (only after a layout change: the converted copy)
    <save>/latest                   "global_step100"

``COMMITTED`` is written last, by rank 0, after every rank has finished writing and the files are
fsynced; ``latest`` is replaced atomically afterwards. A process killed at any moment therefore
leaves either a committed checkpoint or a directory without a marker, which loading skips with a
warning. A step saved again by another trajectory (a rewind with ``iteration``) is written to
``global_step100.replacing/``, committed there and then swapped in (:func:`replace_checkpoint`).
These helpers only touch the file system; the barrier around them lives in ``save_load.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.atomic_files import atomic_write_text, fsync_dir
from megatron.checkpointing.retention import CheckpointKind

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

COMMIT_MARKER = "COMMITTED"
LATEST_FILE = "latest"
TAG_PREFIX = "global_step"
REPLACING_SUFFIX = ".replacing"
"""The new copy of a step being saved again, until it takes the old one's place."""
_TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")


def tag_for(step: int) -> str:
    """GPT-NeoX's directory name for the checkpoint after ``step`` iterations."""
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> int | None:
    match = _TAG_RE.match(tag)
    return int(match.group(1)) if match else None


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and the directories themselves, deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@dataclass(frozen=True)
class CommitInfo:
    """The marker's content: enough for retention and for a quick listing."""

    step: int
    kind: CheckpointKind
    time: float

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "kind": self.kind, "time": self.time})

    @staticmethod
    def from_json(text: str) -> CommitInfo:
        raw: dict[str, Any] = json.loads(text)
        return CommitInfo(step=int(raw["step"]), kind=raw.get("kind", "step"), time=float(raw.get("time", 0.0)))


def write_commit_marker(ckpt_dir: Path, info: CommitInfo) -> None:
    """Seal a finished checkpoint: fsync its files, then write the marker atomically."""
    fsync_tree(ckpt_dir)
    atomic_write_text(ckpt_dir / COMMIT_MARKER, info.to_json())


def read_commit_marker(ckpt_dir: Path) -> CommitInfo | None:
    marker = ckpt_dir / COMMIT_MARKER
    if not marker.is_file():
        return None
    try:
        return CommitInfo.from_json(marker.read_text(encoding="utf-8"))
    except (ValueError, KeyError) as err:
        log.warning("unreadable commit marker %s (%s); treating the checkpoint as incomplete", marker, err)
        return None


def is_committed(ckpt_dir: Path) -> bool:
    return read_commit_marker(ckpt_dir) is not None


def write_latest(save_dir: Path, tag: str) -> None:
    atomic_write_text(save_dir / LATEST_FILE, tag + "\n")


def read_latest(save_dir: Path) -> str | None:
    path = save_dir / LATEST_FILE
    if not path.is_file():
        return None
    tag = path.read_text(encoding="utf-8").strip()
    return tag or None


@dataclass(frozen=True)
class Listing:
    """Checkpoints found in a save directory, split by whether they were committed."""

    committed: dict[int, CommitInfo]
    incomplete: list[str]

    @property
    def steps(self) -> list[int]:
        return sorted(self.committed)


def list_checkpoints(save_dir: Path) -> Listing:
    committed: dict[int, CommitInfo] = {}
    incomplete: list[str] = []
    if not save_dir.is_dir():
        return Listing(committed, incomplete)
    for entry in sorted(save_dir.iterdir()):
        step = step_of(entry.name)
        if step is None or not entry.is_dir():
            continue
        info = read_commit_marker(entry)
        if info is None:
            incomplete.append(entry.name)
        else:
            committed[step] = info
    return Listing(committed, incomplete)


def newest_committed(save_dir: Path) -> tuple[str | None, list[str]]:
    """The tag to resume from, and warnings about what was skipped on the way.

    ``latest`` is trusted when it names a committed checkpoint; otherwise (a crash between
    writing the files and the marker, or a hand-edited ``latest``) the newest committed one wins.
    """
    listing = list_checkpoints(save_dir)
    latest = read_latest(save_dir)
    if latest is not None and step_of(latest) in listing.committed:
        chosen: str | None = latest
    else:
        chosen = tag_for(listing.steps[-1]) if listing.committed else None
    using = f"; the last committed one is {chosen}" if chosen else "; there is no committed one"
    warnings = [f"skipping incomplete checkpoint {save_dir / name} (no {COMMIT_MARKER} marker: its save was "
                f"interrupted){using}" for name in listing.incomplete]  # fmt: skip
    if chosen is not None and latest is not None and chosen != latest:
        warnings.append(f"'latest' names {latest!r}, which is not a committed checkpoint; using {chosen}")
    return chosen, warnings


def replace_checkpoint(save_dir: Path, step: int, committed_copy: Path) -> None:
    """Put ``committed_copy`` (a committed checkpoint of ``step`` beside the save directory's own) in place of
    ``<save>/global_step<step>``: the old one and its cached universal conversion are un-committed and removed,
    then the copy is renamed. Only the moment between the un-commit and the rename has no committed copy of the
    step (a crash there resumes from the newest other committed checkpoint)."""
    final = save_dir / tag_for(step)
    retired = save_dir / (tag_for(step) + ".replaced")
    if retired.exists():
        shutil.rmtree(retired, ignore_errors=True)
    for stale in (final / COMMIT_MARKER, save_dir / f"{tag_for(step)}_universal" / COMMIT_MARKER):
        if stale.exists():
            stale.unlink()
            fsync_dir(stale.parent)
    if final.exists():
        os.rename(final, retired)
    os.rename(committed_copy, final)
    fsync_dir(save_dir)
    shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(save_dir / f"{tag_for(step)}_universal", ignore_errors=True)


def remove_checkpoint(save_dir: Path, step: int) -> None:
    """Delete a checkpoint: un-commit it first, so a crash mid-delete leaves no half checkpoint
    that still looks complete."""
    for path in (save_dir / tag_for(step), save_dir / f"{tag_for(step)}_universal"):
        if not path.exists():
            continue
        marker = path / COMMIT_MARKER
        if marker.exists():
            marker.unlink()
            fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
