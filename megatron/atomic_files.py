"""Atomic file writes: readers see the old file or the complete new one, never a torn one.

Everything Deepy writes that something else reads back (resolved configs, sample-index caches,
checkpoint markers and ``latest``, tokenizers, the built-in corpus) goes through here: write to a
temporary file in the same directory, fsync it, ``os.replace`` it over the target, fsync the
directory so the rename itself survives a crash. On failure the temporary file is removed.
The file ends with the mode an ``open()`` gives (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``: a
checkpoint's ``latest`` and marker, a shared sample-index cache, are read by other accounts as its other files are.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a directory entry (a rename or a new file), not just the file contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it (Linux's ``/proc``); elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block succeeds it becomes ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # what open() would have created
        yield Path(tmp)
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def follow_umask(root: Path) -> None:
    """Give ``root`` and everything below it the modes ``mkdir`` and ``open`` give (``0o777``/``0o666`` less the
    umask), as a checkpoint's files have: libraries that write privately (safetensors 0.8: ``0o600``) would keep a
    model from the other accounts the umask lets read it."""
    mask = umask()
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
