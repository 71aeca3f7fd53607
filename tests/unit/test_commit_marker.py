"""Commit marker and atomic ``latest``: a checkpoint is visible only once it is sealed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from megatron.checkpointing import commit
from megatron.checkpointing.commit import CommitInfo


def make_ckpt(save: Path, step: int, committed: bool, kind: str = "step") -> Path:
    path = save / commit.tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 16)
    if committed:
        commit.write_commit_marker(path, CommitInfo(step=step, kind=kind, time=time.time()))  # type: ignore[arg-type]
    return path


def test_tags_round_trip() -> None:
    assert commit.tag_for(120) == "global_step120"
    assert commit.step_of("global_step120") == 120
    assert commit.step_of("global_step120_universal") is None
    assert commit.step_of("latest") is None


def test_marker_round_trip_and_listing(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, committed=True, kind="temporary")
    make_ckpt(tmp_path, 20, committed=False)
    (tmp_path / "global_step10_universal").mkdir()
    listing = commit.list_checkpoints(tmp_path)
    assert listing.steps == [10]
    assert listing.committed[10].kind == "temporary"
    assert listing.incomplete == ["global_step20"]


def test_latest_is_replaced_atomically(tmp_path: Path) -> None:
    commit.write_latest(tmp_path, "global_step5")
    commit.write_latest(tmp_path, "global_step6")
    assert commit.read_latest(tmp_path) == "global_step6"
    # no temporary files are left behind
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_incomplete_newest_is_skipped_with_a_warning(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, committed=True)
    commit.write_latest(tmp_path, "global_step10")
    make_ckpt(tmp_path, 20, committed=False)  # killed before the marker
    tag, warnings = commit.newest_committed(tmp_path)
    assert tag == "global_step10"
    assert any("global_step20" in w for w in warnings)


def test_latest_pointing_at_an_uncommitted_dir_falls_back(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, committed=True)
    make_ckpt(tmp_path, 30, committed=True)
    make_ckpt(tmp_path, 40, committed=False)
    commit.write_latest(tmp_path, "global_step40")
    tag, warnings = commit.newest_committed(tmp_path)
    assert tag == "global_step30"
    assert any("'latest' names" in w for w in warnings)


def test_nothing_to_resume(tmp_path: Path) -> None:
    assert commit.newest_committed(tmp_path / "missing") == (None, [])
    make_ckpt(tmp_path, 3, committed=False)
    tag, warnings = commit.newest_committed(tmp_path)
    assert tag is None and len(warnings) == 1


def test_garbled_marker_counts_as_incomplete(tmp_path: Path) -> None:
    path = make_ckpt(tmp_path, 10, committed=False)
    (path / commit.COMMIT_MARKER).write_text("{not json")
    assert not commit.is_committed(path)


def test_remove_checkpoint_uncommits_first(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, committed=True)
    (tmp_path / "global_step10_universal").mkdir()
    commit.remove_checkpoint(tmp_path, 10)
    assert not (tmp_path / "global_step10").exists()
    assert not (tmp_path / "global_step10_universal").exists()


def test_marker_write_fails_loudly_on_a_read_only_dir(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores directory permissions; simulate the failure with a path that is a file
        path = tmp_path / "global_step1"
        path.write_text("not a directory")
        with pytest.raises(OSError):
            commit.write_commit_marker(path, CommitInfo(1, "step", 0.0))
        return
    path = make_ckpt(tmp_path, 1, committed=False)
    path.chmod(0o500)
    try:
        with pytest.raises(OSError):
            commit.write_commit_marker(path, CommitInfo(1, "step", 0.0))
    finally:
        path.chmod(0o700)


def test_replace_checkpoint_swaps_in_the_new_copy_and_drops_the_stale_conversion(tmp_path: Path) -> None:
    """A rewound run saving a step the directory holds (issue 30 item 2): the new copy takes the old one's
    place, and the old one's cached universal conversion goes with it (it would be reused for the new one)."""
    old = make_ckpt(tmp_path, 12, committed=True)
    (old / "mp_rank_00_model_states.pt").write_bytes(b"old")
    stale = tmp_path / "global_step12_universal"
    stale.mkdir()
    commit.write_commit_marker(stale, CommitInfo(step=12, kind="step", time=time.time()))
    new = tmp_path / ("global_step12" + commit.REPLACING_SUFFIX)
    new.mkdir()
    (new / "mp_rank_00_model_states.pt").write_bytes(b"new")
    commit.write_commit_marker(new, CommitInfo(step=12, kind="step", time=time.time()))
    assert commit.list_checkpoints(tmp_path).steps == [12]  # the copy is invisible until swapped in
    commit.replace_checkpoint(tmp_path, 12, new)
    assert (tmp_path / "global_step12" / "mp_rank_00_model_states.pt").read_bytes() == b"new"
    assert commit.is_committed(tmp_path / "global_step12")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step12"]
