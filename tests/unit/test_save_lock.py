"""The lock of a ``save`` directory (issue 42 item 13; megatron/launcher/save_lock.py): a running holder
refuses a second launch, a stale one (dead pid, reused pid, another machine's lock without a heartbeat) is
taken over with a note, and launches that do not write into ``save`` neither take nor mind it.

The end-to-end cases (a second launch while a run trains, a run killed by SIGKILL whose lock the next
launch takes over) are in tests/e2e/test_crash_safety.py; here, locks written as other processes would."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.checkpointing.discovery import inspect_load_dir
from megatron.errors import ConfigError
from megatron.launcher.save_lock import (LOCK_NAME, STALE_AFTER_S, Holder, SaveDirInUse, acquire, current_holder,
                                         this_process)

REPO = Path(__file__).resolve().parents[2]


def _plant(save: Path, holder: Holder, age_s: float = 0.0) -> Path:
    save.mkdir(parents=True, exist_ok=True)
    lock = save / LOCK_NAME
    lock.write_text(json.dumps(dataclasses.asdict(holder)))
    if age_s:
        then = time.time() - age_s
        os.utime(lock, (then, then))
    return lock


def test_a_running_holder_refuses_and_its_release_frees_the_directory(tmp_path: Path) -> None:
    first, note = acquire(tmp_path / "ckpt", this_process("python deepy.py train.py a.yml", "run-a", "logs/run-a"))
    assert note is None and inspect_load_dir(tmp_path / "ckpt").kind == "empty"  # the lock is no checkpoint
    with pytest.raises(SaveDirInUse) as busy:
        acquire(tmp_path / "ckpt", this_process("python deepy.py train.py b.yml"))
    said = busy.value.describe()
    assert f"deepy.py pid {os.getpid()} on host " in said and "run run-a (logs/run-a)" in said
    assert "python deepy.py train.py a.yml" in said and "that process is running" in said
    held = current_holder(tmp_path / "ckpt")
    assert held is not None and held[0] == first.holder
    first.release()
    assert current_holder(tmp_path / "ckpt") is None and list((tmp_path / "ckpt").iterdir()) == []


def test_a_dead_or_reused_pid_is_taken_over_with_a_note(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = dataclasses.replace(this_process("python deepy.py train.py old.yml", "old-run"), pid=gone.pid)
    _plant(tmp_path / "a", dead)
    lock, note = acquire(tmp_path / "a", this_process("new"))
    assert note is not None and "(no such process)" in note and f"pid {gone.pid}" in note and "old-run" in note
    held = current_holder(tmp_path / "a")
    assert held is not None and held[0] == lock.holder
    lock.release()
    # this very pid, but a process started at another time: the pid was reused
    reused = dataclasses.replace(this_process("python deepy.py train.py old.yml"), start_ticks="1")
    _plant(tmp_path / "b", reused)
    lock, note = acquire(tmp_path / "b", this_process("new"))
    assert note is not None and "its pid is another process now" in note
    lock.release()


def test_another_machines_lock_counts_while_its_heartbeat_is_recent(tmp_path: Path) -> None:
    remote = dataclasses.replace(this_process("python deepy.py train.py a.yml"), host="node-elsewhere", pid=1)
    _plant(tmp_path / "ckpt", remote, age_s=STALE_AFTER_S / 2)
    with pytest.raises(SaveDirInUse) as busy:
        acquire(tmp_path / "ckpt", this_process("new"))
    assert "on host node-elsewhere" in busy.value.describe() and "another machine" in busy.value.describe()
    _plant(tmp_path / "ckpt", remote, age_s=STALE_AFTER_S + 10)
    lock, note = acquire(tmp_path / "ckpt", this_process("new"))
    assert note is not None and f"its lock was not touched for {STALE_AFTER_S:.0f} s" in note
    lock.release()


def test_only_launches_that_train_into_save_take_or_mind_the_lock(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """generate.py and eval.py read a checkpoint and write nothing into `save`."""
    from megatron.app.deepy import parse_command, plan_run, resolve, save_lock_note, take_save_lock

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yml").write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n"
                                    "max_position_embeddings: 32\ntrain_batch_size: 8\ntrain_iters: 2\n"
                                    "use_dummy_dataset: true\ntokenizer_type: CharLevelTokenizer\nlr: 0.001\n"
                                    "save: ckpt\ncheckpoint_factor: 1\n")
    command = parse_command([str(REPO / "train.py"), "m.yml"])
    resolved = resolve(command)
    plan = plan_run(resolved, command.user_script, str(tmp_path / "deepy_config.json"))
    held, _ = acquire(tmp_path / "ckpt", this_process("python deepy.py train.py m.yml", "running"))
    try:
        for script, refused in (("train.py", True), ("generate.py", False), ("eval.py", False)):
            launch = dataclasses.replace(command, user_script=str(REPO / script))
            assert (save_lock_note(resolved, launch.user_script) is not None) is refused
            if refused:
                with pytest.raises(ConfigError, match="another run is training into it"):
                    take_save_lock(resolved, launch, plan)
            else:
                assert take_save_lock(resolved, launch, plan) is None
    finally:
        held.release()
