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

Retention:
When to save a checkpoint and which old ones to delete: a pure policy object.

Three families of rules meet here, each from a project that users already know:

* GPT-NeoX step saves: every ``checkpoint_factor`` steps (``checkpoint_scale: linear``) or at the
  powers of ``checkpoint_factor`` (``checkpoint_scale: log``), plus ``extra_save_iters``; the oldest
  of these are pruned down to ``keep_last_n_checkpoints``.
* Levanter time saves (``save_interval: 15min``): *temporary* checkpoints that exist only so a
  crash loses little work. The previous temporary one is deleted only after a newer checkpoint is
  committed, so there is always one complete checkpoint on disk.
* Levanter permanent steps (``keep: [{every: 1000, until: 10000}, {every: 5000}]``): never deleted.

The policy never touches the disk or a clock of its own: it gets the time from an injected
``clock`` and the list of committed checkpoints from the caller, so every rule is unit-testable
with a fake clock. Every rank runs it; for the clock's part rank 0's answer is agreed (``manager.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron.atomic_files import atomic_write_text, fsync_dir

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


# --- Retention -----------------------------------------------------------------------------------
CheckpointKind = Literal["permanent", "step", "temporary"]

# Ordered by how long a checkpoint of that kind must survive; when one step matches several
# rules the longest-lived kind wins.
_KIND_RANK: dict[CheckpointKind, int] = {"temporary": 0, "step": 1, "permanent": 2}


@dataclass(frozen=True)
class KeepRule:
    """Keep every ``every``-th step for good, up to and including ``until`` (None = forever)."""

    every: int
    until: int | None = None

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"keep rule 'every' must be a positive step count, got {self.every}")

    def matches(self, step: int) -> bool:
        return step > 0 and step % self.every == 0 and (self.until is None or step <= self.until)


@dataclass(frozen=True)
class SaveDecision:
    """Whether to save after a step, and how long the checkpoint should live."""

    save: bool
    kind: CheckpointKind = "step"
    reason: str = ""


NO_SAVE = SaveDecision(save=False, reason="")


@dataclass(frozen=True)
class CommittedCheckpoint:
    """What retention needs to know about a checkpoint already on disk."""

    step: int
    kind: CheckpointKind


def step_save_iterations(
    checkpoint_factor: int | None,
    checkpoint_scale: Literal["linear", "log"],
    extra_save_iters: Iterable[int] | None,
    train_iters: int,
) -> frozenset[int]:
    """The GPT-NeoX step schedule as an explicit set, so it can be printed and tested."""
    steps: set[int] = set(extra_save_iters or ())
    if checkpoint_factor:
        if checkpoint_scale == "linear":
            steps.update(range(checkpoint_factor, train_iters + 1, checkpoint_factor))
        elif checkpoint_scale == "log":
            if checkpoint_factor < 2:
                raise ValueError("checkpoint_scale 'log' needs checkpoint_factor >= 2")
            power = checkpoint_factor
            while power <= train_iters:
                steps.add(power)
                power *= checkpoint_factor
        else:
            raise ValueError(f"unknown checkpoint_scale {checkpoint_scale!r}; use 'linear' or 'log'")
    return frozenset(s for s in steps if 0 < s <= train_iters)


class RetentionPolicy:
    """Decides after each step whether to save, and after each commit what to delete."""

    def __init__(
        self,
        *,
        train_iters: int,
        checkpoint_factor: int | None = None,
        checkpoint_scale: Literal["linear", "log"] = "linear",
        extra_save_iters: Iterable[int] | None = None,
        keep_last_n_checkpoints: int | None = None,
        save_interval_s: float | None = None,
        keep: Sequence[KeepRule] = (),
        save_at_end: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep_last_n_checkpoints is not None and keep_last_n_checkpoints < 1:
            raise ValueError("keep_last_n_checkpoints must be at least 1 (or unset to keep all)")
        if save_interval_s is not None and save_interval_s <= 0:
            raise ValueError("save_interval must be a positive duration")
        self.train_iters = train_iters
        self.step_saves = step_save_iterations(checkpoint_factor, checkpoint_scale, extra_save_iters, train_iters)
        self.keep_last_n = keep_last_n_checkpoints
        self.save_interval_s = save_interval_s
        self.keep_rules = tuple(keep)
        self.save_at_end = save_at_end
        self._clock = clock
        # The interval counts from the start of this process: a resumed run should not save
        # immediately just because the previous run's last save is long ago.
        self._last_commit_time = clock()

    # --- when to save ------------------------------------------------------------------------
    def interval_elapsed(self) -> bool:
        """The clock's part of :meth:`decide`: ``save_interval`` has passed since the last commit."""
        return self.save_interval_s is not None and self._clock() - self._last_commit_time >= self.save_interval_s

    def decide(self, step: int, time_due: bool | None = None) -> SaveDecision:
        """Called after ``step`` (the number of completed iterations) has finished. ``time_due``: the
        clock's answer agreed by the ranks (rank 0's, ``manager.py``); None asks this policy's clock."""
        kinds: list[tuple[CheckpointKind, str]] = []
        if any(rule.matches(step) for rule in self.keep_rules):
            kinds.append(("permanent", "keep rule"))
        if step in self.step_saves:
            kinds.append(("step", "step schedule"))
        if self.save_at_end and step == self.train_iters:
            kinds.append(("step", "end of training"))
        if self.save_interval_s is not None and (self.interval_elapsed() if time_due is None else time_due):
            kinds.append(("temporary", f"{self.save_interval_s:g}s since the last save"))
        if not kinds:
            return NO_SAVE
        kind, _ = max(kinds, key=lambda k: _KIND_RANK[k[0]])
        return SaveDecision(save=True, kind=kind, reason=", ".join(reason for _, reason in kinds))

    def on_committed(self) -> None:
        """Restart the time-based interval: any committed checkpoint bounds the work at risk."""
        self._last_commit_time = self._clock()

    # --- what to delete ----------------------------------------------------------------------
    def to_delete(self, committed: Iterable[CommittedCheckpoint]) -> list[int]:
        """Steps of checkpoints to remove, given every *committed* checkpoint on disk.

        The newest committed checkpoint is never deleted, whatever its kind: it is what a crash
        would resume from.
        """
        ckpts = sorted(committed, key=lambda c: c.step)
        if not ckpts:
            return []
        newest = ckpts[-1].step
        doomed: set[int] = set()
        for ckpt in ckpts:
            # a permanent step stays permanent even if an old run saved it as another kind
            if ckpt.kind == "permanent" or any(rule.matches(ckpt.step) for rule in self.keep_rules):
                continue
            if ckpt.kind == "temporary" and ckpt.step != newest:
                doomed.add(ckpt.step)
        if self.keep_last_n is not None:
            step_kind = [
                c.step
                for c in ckpts
                if c.kind == "step" and not any(rule.matches(c.step) for rule in self.keep_rules)
            ]
            doomed.update(step_kind[: max(len(step_kind) - self.keep_last_n, 0)])
        doomed.discard(newest)
        return sorted(doomed)
