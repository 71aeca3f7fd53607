"""Checkpoints in object storage: a run's save directory mirrored to a bucket.

Two ways, one mechanism (a local directory of committed checkpoints and a remote prefix that follows it):

* GPT-NeoX's ``s3_path``: after each committed save, rank 0 uploads the checkpoint's files to
  ``<s3_path>/<basename of save>/<tag>/<same relative paths>``, in multipart parts of ``s3_chunk_size``
  (EleutherAI/gpt-neox@ea7aefd8 ``megatron/checkpointing.py``: ``upload_checkpoint``, ``_upload``; it uploads
  from rank 0, so ``save`` is a file system every node shares). ``keep_last_n_checkpoints`` deletes local
  checkpoints only, as GPT-NeoX's ``delete_old_checkpoints``; nothing in the bucket is ever deleted. Deepy's
  commit marker is one of the checkpoint's files and goes last.
* ``save``/``load`` naming a bucket (``s3://bucket/run``): the checkpoints are written to a local staging
  directory (``checkpoint_staging_dir``), each node's first rank uploads what its node wrote, and once every
  node has, rank 0 uploads the commit marker and then ``latest``: an object prefix without its marker is never
  loaded. Before loading, the staging directory is made to hold exactly the bucket's committed checkpoints
  (their small files; the one to resume from whole), so a run resumes on a machine that never saw the run.
  Retention deletes in the bucket too: the bucket is the save directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron import object_store
from megatron.object_store import cache_home
from megatron.checkpointing import commit

log = logging.getLogger("deepy.checkpoint")

SMALL_FILES = (commit.COMMIT_MARKER, "deepy_meta.json")
"""What a committed checkpoint's listing and the checks before launch read (the rest is fetched to load it)."""



def staging_dir(url: str, root: str | None) -> Path:
    """The local directory that stands for ``url``: ``<root>/<scheme>/<bucket>/<prefix>`` (one per URL, so two runs
    in different buckets never share files; ``object_store.local_dir_for``)."""
    return object_store.local_dir_for(url, Path(os.path.expanduser(root)) if root else cache_home() / "deepy" / "staging")


@dataclass(frozen=True)
class Mirror:
    """A remote prefix that follows the local save directory's committed checkpoints."""

    url: str
    chunk_size: int
    is_save: bool
    """True: the bucket is the run's ``save`` (markers and ``latest`` in it, retention deletes there, loads
    come from it); False: GPT-NeoX's ``s3_path`` copy."""

    @staticmethod
    def for_s3_path(s3_path: str, save: str, chunk_size: int) -> Mirror:
        # os.path.join(s3_path, os.path.basename(save), tag): GPT-NeoX's remote_checkpoint_path
        return Mirror(object_store.join(s3_path, os.path.basename(save)), chunk_size, is_save=False)

    def uploads_on(self, rank: int, local_rank: int) -> bool:
        """Which ranks upload: rank 0 for ``s3_path`` (as GPT-NeoX), each node's first rank for a bucket ``save``."""
        return local_rank == 0 if self.is_save else rank == 0

    def upload(self, local_save: Path, tag: str) -> None:
        """The checkpoint's files; the commit marker last (``s3_path``) or not at all (it is ``seal``'s)."""
        remote = object_store.join(self.url, tag)
        if self.is_save:
            object_store.upload_tree(local_save / tag, remote, self.chunk_size, skip=[commit.COMMIT_MARKER])
        else:
            object_store.upload_tree(local_save / tag, remote, self.chunk_size, last=[commit.COMMIT_MARKER])
        log.info("uploaded %s to %s", local_save / tag, remote)

    def seal(self, local_save: Path, tag: str) -> None:
        """Rank 0, once every node's files are up: the marker, then ``latest``."""
        store = object_store.store_for(self.url)
        store.put_file(local_save / tag / commit.COMMIT_MARKER, object_store.join(self.url, tag, commit.COMMIT_MARKER),
                       self.chunk_size)
        store.write_text(object_store.join(self.url, commit.LATEST_FILE), tag + "\n")

    def delete(self, tag: str) -> None:
        if self.is_save:
            object_store.store_for(self.url).delete(object_store.join(self.url, tag))

    def committed_tags(self) -> list[str]:
        """The bucket's committed checkpoints, oldest first."""
        entries = object_store.store_for(self.url).list(self.url)
        tags = {e.key.split("/", 1)[0] for e in entries if e.key.endswith("/" + commit.COMMIT_MARKER)}
        return sorted((t for t in tags if commit.step_of(t) is not None), key=lambda t: commit.step_of(t) or 0)

    def sync_listing(self, local_save: Path) -> list[str]:
        """Make ``local_save`` list what the bucket holds: each committed checkpoint's small files and ``latest``;
        a local checkpoint the bucket does not hold committed (its upload never finished) is removed."""
        tags = self.committed_tags()
        local_save.mkdir(parents=True, exist_ok=True)
        for child in local_save.iterdir():
            if child.is_dir() and commit.step_of(child.name) is not None and child.name not in tags:
                shutil.rmtree(child, ignore_errors=True)
        store = object_store.store_for(self.url)
        for tag in tags:
            for name in SMALL_FILES:
                store.get_file(object_store.join(self.url, tag, name), local_save / tag / name)
        latest = store.read_text(object_store.join(self.url, commit.LATEST_FILE))
        if latest:
            commit.write_latest(local_save, latest.strip())
        elif (local_save / commit.LATEST_FILE).exists():
            (local_save / commit.LATEST_FILE).unlink()
        return tags

    def fetch(self, local_save: Path, tag: str) -> None:
        """The whole committed checkpoint ``tag``, marker last (a crash while downloading leaves it uncommitted)."""
        local = local_save / tag
        marker = local / commit.COMMIT_MARKER
        if marker.exists():
            marker.unlink()
        keys = object_store.download_tree(object_store.join(self.url, tag), local, skip=[commit.COMMIT_MARKER])
        object_store.store_for(self.url).get_file(object_store.join(self.url, tag, commit.COMMIT_MARKER), marker)
        log.info("downloaded %s (%d files) into %s", object_store.join(self.url, tag), len(keys) + 1, local)


def remote_resume_point(url: str, iteration: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """``discovery.resume_point`` for a bucket: the committed checkpoint a resume from ``url`` would load
    (``iteration``'s, else the newest) as its URL, and its ``deepy_meta.json``; None when there is none or its
    metadata is unreadable. Reads the listing and one small object (deepy.py's checks before launch)."""
    tags = Mirror(url, 0, is_save=True).committed_tags()
    tag = commit.tag_for(iteration) if iteration is not None else (tags[-1] if tags else None)
    if tag is None or tag not in tags:
        return None
    text = object_store.store_for(url).read_text(object_store.join(url, tag, "deepy_meta.json"))
    try:
        meta = json.loads(text) if text else None
    except ValueError:
        return None
    return (object_store.join(url, tag), meta) if isinstance(meta, dict) else None
