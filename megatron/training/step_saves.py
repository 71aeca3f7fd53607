"""Directories written at Levanter's hook steps, whole: what the HF model saves (``hf_saves.py``) and the PEFT
adapter saves (``peft_saves.py``) share.

Levanter (stanford-crfm/levanter 9263f81e) runs a hook when ``info.step % every == 0`` (``trainer.py:97-100``) and
once more, forced, after the last step (``trainer.py:448-449``), where ``info.step`` is the 0-based step just
completed (``int(state.step) - 1``, ``callbacks/_core.py:37``); the save callbacks skip ``info.step == 0``
(``compat/hf_checkpoints.py:1049-1050``, ``lora.py:384-387,437-438``) and write ``<base>/step-<info.step>``.
A step directory appears whole: filled beside its place, its files persisted, then renamed in.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from megatron.atomic_files import fsync_dir


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
    again, by the forced last hook or a resumed run, replaces the old one)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        fill(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
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
