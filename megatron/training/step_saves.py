"""Directories written at Levanter's hook steps, whole: what the HF model saves (``hf_saves.py``) and the PEFT
adapter saves (``peft_saves.py``) share.

Levanter (stanford-crfm/levanter 9263f81e) runs a hook when ``info.step % every == 0`` (``trainer.py:97-100``) and
once more, forced, after the last step (``trainer.py:448-449``), where ``info.step`` is the 0-based step just
completed (``int(state.step) - 1``, ``callbacks/_core.py:37``); the save callbacks skip ``info.step == 0``
(``compat/hf_checkpoints.py:1049-1050``, ``lora.py:384-387,437-438``) and write ``<base>/step-<info.step>``.
A step directory appears whole: filled beside its place (``.step-N.partial-<hex>``), its files persisted, then
renamed in; its directories and files get the modes a checkpoint's get (``0o777``/``0o666`` less the umask).

Every rank runs the hooks (under ZeRO-3 a save gathers the partitions on every rank) and rank 0 writes. What the
hooks decide from the disk (is a save already there?) is rank 0's answer, agreed by every rank (``agree``), so
that all of them enter a save's collectives or none does. A save killed while writing is written by the resumed
run: the Deepy checkpoint of that step is committed before the hooks of its step run, so the resumed run starts
from it and writes the save that is missing (:meth:`StepSaves.resume`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron import object_store
from megatron.atomic_files import follow_umask, fsync_dir
from megatron.checkpointing.remote import staging_dir
from megatron.errors import CheckpointError

log = logging.getLogger("deepy.saves")  # a child of the run logger: rank 0 speaks

UPLOAD_PART = 100 * 1024 * 1024
"""Part size of a save's multipart uploads (GPT-NeoX's ``s3_chunk_size`` default)."""

Agree = Callable[[bool], bool]
"""Rank 0's answer, on every rank (``megatron.mpu.rank0_decides``; in one process, the answer itself)."""

PARTIAL = re.compile(r"^\.step-\d+\.(partial-[0-9a-f]{8}|[a-z0-9_]{8})$")
"""A step directory a writer was filling: ``.step-N.partial-<8 hex>`` (``.step-N.<8 characters>``: the
``tempfile.mkdtemp`` names of earlier releases). Nothing else in a save directory is touched."""


def alone(value: bool) -> bool:
    """The agreement of a single process: its own answer."""
    return value


def levanter_step(completed: int) -> int:
    """Levanter's ``info.step``: the 0-based number of the step just completed."""
    return completed - 1


def save_due(completed: int, every: int, *, last: bool) -> bool:
    """Whether Levanter's hook writes after ``completed`` steps: every ``every``-th 0-based step and after the
    last one, never after the first (step 0)."""
    step = levanter_step(completed)
    return step > 0 and (last or step % every == 0)


def step_dir(base: str | os.PathLike[str], completed: int) -> Path:
    """``<base>/step-<0-based step>`` (Levanter's dialect puts its run id into ``base``)."""
    return Path(base) / f"step-{levanter_step(completed)}"


def write_whole(directory: Path, fill: Callable[[Path], None]) -> None:
    """``fill`` a new directory beside ``directory``, persist its files and rename it into place (a step written
    again, by a resumed run, replaces the old one). Its directories and files get the modes ``mkdir`` and ``open``
    give (the umask decides, as for a checkpoint's), also those a library wrote privately (safetensors 0.8 writes
    ``0o600``)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.partial-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        fill(tmp)
        follow_umask(tmp)
        for path in tmp.rglob("*"):
            if path.is_file() and not path.is_symlink():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory.parent)


def remove_partials(base: Path) -> list[Path]:
    """Remove the step directories a killed writer left half-filled in ``base`` (:data:`PARTIAL`); the removed."""
    if not base.is_dir():
        return []
    found = sorted(p for p in base.iterdir() if PARTIAL.match(p.name) and p.is_dir() and not p.is_symlink())
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def missing_before(base: Path, completed: int, every: int, shown: int = 4) -> tuple[int, list[str]]:
    """The saves due every ``every`` steps before the one after ``completed`` steps that ``base`` lacks while it
    holds others (a run that never wrote there, one that set the key only now, lacks them all, as expected): how
    many, and the names of the first ``shown``."""
    present = {p.name for p in base.iterdir() if p.name.startswith("step-")} if base.is_dir() else set()
    if not present:
        return 0, []
    missing = [name for step in range(every, levanter_step(completed), every)
               if (name := f"step-{step}") not in present]
    return len(missing), missing[:shown]


class StepSaves:
    """The loop's hooks that write one directory per save into ``base``: ``after_step`` (every ``every``-th
    0-based step), ``at_exit`` (the last step, once) and :meth:`resume` (before the first step of a resumed run).
    A subclass gives the save's contents (:meth:`_write`) and says what was written (:meth:`describe`)."""

    key = "save_path"
    """The config key of ``base`` (in messages)."""

    def __init__(self, base: str, every: int, writer: bool, agree: Agree = alone) -> None:
        """``writer``: this rank writes (global rank 0, the one ``agree`` takes the answer of). ``base`` in object
        storage (``s3://...``, as Levanter's ``hf_save_path`` on ``gs://``): each save is written whole into a
        local staging directory, uploaded to ``<base>/step-N/``, and removed here."""
        self.url = base if object_store.is_remote(base) else None
        local = staging_dir(base, None) if self.url is not None else Path(base)
        self.base, self.every, self.writer, self.agree = local, every, writer, agree
        self.saved: int | None = None
        """The completed steps of the latest save this run wrote or found, the same on every rank."""
        self.written: list[Path] = []
        """The directories this rank wrote, in order (the writer's)."""

    def _write(self, completed: int, target: Path) -> None:
        """Every rank: take part in reading the weights; the writer: write them into ``target`` whole."""
        raise NotImplementedError

    def describe(self, completed: int, target: Path) -> str:
        """The console line of a save just written."""
        return f"{self.key}: wrote {target}"

    def save(self, completed: int) -> None:
        target = step_dir(self.base, completed)
        try:
            self._write(completed, target)
        except OSError as err:  # disk full, permissions: the writer's; the launcher stops the other ranks
            raise CheckpointError(
                f"{self.key}: writing {target} failed ({type(err).__name__}: {err}); nothing of it was left behind "
                f"and the earlier saves and checkpoints are untouched. Free space or fix permissions, then run the "
                f"same command again: it resumes from the last checkpoint and writes the saves due from there"
            ) from err
        if self.url is not None and self.writer:
            remote = object_store.join(self.url, target.name)
            try:
                object_store.upload_tree(target, remote, UPLOAD_PART)
            except Exception as err:  # noqa: BLE001 - the store's own errors (network, permissions)
                raise CheckpointError(f"{self.key}: uploading {target} to {remote} failed ({type(err).__name__}: "
                                      f"{err}); run the same command again: it resumes from the last checkpoint and "
                                      "writes the saves due from there") from err
            shutil.rmtree(target, ignore_errors=True)
            target = Path(remote)
        self.saved = completed
        if self.writer:
            self.written.append(target)
            log.info(self.describe(completed, target))

    def _present(self, completed: int) -> bool:
        """The save of ``completed`` steps is written (in the bucket, for a ``base`` there)."""
        if self.url is None:
            return step_dir(self.base, completed).is_dir()
        name = step_dir(self.base, completed).name
        return bool(object_store.store_for(self.url).list(object_store.join(self.url, name)))

    def after_step(self, _eng: Any, state: Any) -> None:
        if save_due(state.iteration, self.every, last=False):
            self.save(state.iteration)

    def at_exit(self, _eng: Any, state: Any) -> None:
        # Levanter's forced hook after the last step; it writes the step again when its after_step hook just did
        # (the same weights: nothing changes between the two), here it is written once. ``saved`` is set on every
        # rank, so all of them skip it (or gather for it) alike.
        if save_due(state.iteration, self.every, last=True) and self.saved != state.iteration:
            self.save(state.iteration)

    def resume(self, completed: int, last: int) -> None:
        """Before the first step of a run that starts after ``completed`` steps (0: a fresh start), whose last step
        is ``last``; every rank calls it. The writer removes what a killed writer left half-filled; the save of
        ``completed`` itself, when it was due (every ``every`` steps, or the last step of a run that already
        reached it) and is not on disk, is written now: the run was killed inside it, after the checkpoint of that
        step was committed (the checkpoint's hook runs first), and holds that step's weights again. Saves due before
        it that are missing are named: their weights are gone."""
        missing = False
        due = save_due(completed, self.every, last=completed >= last)
        if self.writer:
            for path in remove_partials(self.base):
                log.info("%s: removed %s, a save a killed run left half-written", self.key, path)
            missing = due and not self._present(completed)
            count, names = (missing_before(self.base, completed, self.every) if completed > 0 and self.url is None
                            else (0, []))
            if count:
                more = f" and {count - len(names)} more" if count > len(names) else ""
                log.warning("%s: %d save(s) due before step %d are not in %s (%s%s); this run starts after %d steps "
                            "and cannot write them", self.key, count, levanter_step(completed), self.base,
                            ", ".join(names), more, completed)
        if not due:
            return
        if self.agree(missing):
            if self.writer:
                log.info("%s: %s was due and is missing (a run killed while writing it): writing it from the "
                         "resumed step", self.key, step_dir(self.base, completed))
            self.save(completed)
        else:
            self.saved = completed  # on disk: the forced last save of a run resumed at its end is not written again
