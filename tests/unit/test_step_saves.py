"""The rules every rank follows around the HF and PEFT saves while training (``megatron/training/step_saves.py``):
all ranks take part in the same saves (under ZeRO-3 each save is a gather every rank enters), a save killed while
writing is written by the resumed run and its half-written directory removed, the files follow the umask, and
each save says which Deepy checkpoint step it holds.

The writer and the other ranks are two hook objects here, fed the same steps; the end-to-end runs are
``tests/e2e/test_lora.py`` (2 ZeRO-3 ranks) and ``tests/e2e/test_crash_safety.py`` (a rank killed inside a save).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megatron.atomic_files import atomic_write_text
from megatron.training.hf_save_config import HFSaveArgs
from megatron.training.hf_saves import HFSaves
from megatron.training.step_saves import write_whole


def _writer(calls: list[str]) -> Any:
    def write(weights: Any, out_dir: Path) -> None:
        calls.append(out_dir.name)
        (out_dir / "config.json").write_text("{}")
    return write


def _ranks(base: Path, every: int, on_disk: list[bool] | None = None) -> tuple[HFSaves, HFSaves, list[str], list[int]]:
    """Rank 0 (writes) and rank 1 (does not), as pretrain builds them: both read the weights at every save (a
    gather), rank 1 takes rank 0's answer where the disk decides (``on_disk``: rank 0's answers, recorded)."""
    keys = HFSaveArgs(hf_save_path=str(base), hf_save_interval=every)
    written: list[str] = []
    gathers = [0, 0]
    answers: list[bool] = on_disk if on_disk is not None else []

    def gather(rank: int) -> Any:
        def weights() -> dict[str, Any]:
            gathers[rank] += 1
            return {}
        return weights

    def rank0(value: bool) -> bool:
        answers.append(value)
        return value

    def rank1(_value: bool) -> bool:  # the broadcast's answer: what rank 0 said just before (same call order)
        return answers[len(answers) - 1]

    return (HFSaves(keys, gather(0), _writer(written), agree=rank0),
            HFSaves(keys, gather(1), None, agree=rank1), written, gathers)


def _loop(saves: HFSaves, first: int, last: int) -> None:
    """The training loop's calls: after every step, then (at the last step) the exit hook."""
    for iteration in range(first, last + 1):
        saves.after_step(None, SimpleNamespace(iteration=iteration))
    saves.at_exit(None, SimpleNamespace(iteration=last))


@pytest.mark.parametrize("steps, every", [(3, 2), (4, 2), (10, 3), (10, 5), (2, 1), (1, 1)])
def test_every_rank_takes_part_in_the_same_saves(tmp_path: Path, steps: int, every: int) -> None:
    """issue 42 item 1: with the last 0-based step a multiple of the interval (3 steps at 2: step-2), rank 0 found
    the last save written (its own list) and went on to the evaluation while rank 1 gathered for it again: the
    run hung. Every rank now decides from what every rank knows."""
    keys = HFSaveArgs(hf_save_path=str(tmp_path), hf_save_interval=every)
    gathers = [0, 0]

    def weights(rank: int) -> Any:
        return lambda: gathers.__setitem__(rank, gathers[rank] + 1) or {}

    for saves in (HFSaves(keys, weights(0), _writer([])), HFSaves(keys, weights(1), None)):
        _loop(saves, 1, steps)
    due = {n for n in range(1, steps) if n % every == 0} | ({steps - 1} if steps > 1 else set())
    assert {p.name for p in tmp_path.iterdir()} == {f"step-{n}" for n in due}
    assert gathers == [len(due), len(due)]


def test_a_save_killed_while_writing_is_written_by_the_resumed_run(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """issue 42 item 2: killed inside the save of 0-based step 3 (after 4 steps, whose checkpoint was committed
    before the save's hook ran): the resumed run, starting from that checkpoint, writes step-3 before its first
    step and removes the half-written directory; what is not a save's temporary stays."""
    base = tmp_path / "hf"
    (base / "step-3-notes").mkdir(parents=True)
    leftovers = [base / ".step-3.partial-0123abcd", base / ".step-3.k2j4h5_6"]  # ours, and mkdtemp's of before
    for path in leftovers:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    (base / ".step-3.keepme").mkdir()  # not a name a writer gives
    answers: list[bool] = []
    rank0, rank1, written, gathers = _ranks(base, every=3, on_disk=answers)
    with caplog.at_level(logging.INFO, logger="deepy"):
        for saves in (rank0, rank1):
            saves.resume(4, 10)
    assert answers == [True] and gathers == [1, 1]
    assert sorted(p.name for p in base.iterdir()) == [".step-3.keepme", "step-3", "step-3-notes"]
    assert "hf_save_path: " + str(base / "step-3") + " was due and is missing" in caplog.text
    for path in leftovers:
        assert f"removed {path}" in caplog.text
    for saves in (rank0, rank1):  # the run goes on: step-6 and step-9 (the last), each once
        _loop(saves, 5, 10)
    assert sorted(p.name for p in base.iterdir() if p.name.startswith("step-")) == [
        "step-3", "step-3-notes", "step-6", "step-9"]
    assert gathers == [3, 3]


def test_a_finished_run_writes_its_missing_last_save_once(tmp_path: Path) -> None:
    """Killed inside the forced save after the last step (its checkpoint committed): a launch at the end (deepy.py
    launches it, tests/unit/test_resume_exact.py) writes it; when it is there, nothing is written again."""
    base = tmp_path / "hf"
    rank0, rank1, written, gathers = _ranks(base, every=4)
    for saves in (rank0, rank1):
        saves.resume(10, 10)  # 0-based 9: not a multiple of 4, the forced last one
        saves.at_exit(None, SimpleNamespace(iteration=10))  # the loop runs no step, then its exit hooks
    assert (base / "step-9").is_dir() and gathers == [1, 1]
    rank0, rank1, written, gathers = _ranks(base, every=4)
    for saves in (rank0, rank1):
        saves.resume(10, 10)
        saves.at_exit(None, SimpleNamespace(iteration=10))
    assert gathers == [0, 0] and written == []


def test_saves_due_before_the_resumed_step_that_are_missing_are_named(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    base = tmp_path / "hf"
    (base / "step-2").mkdir(parents=True)
    rank0, *_ = _ranks(base, every=2)
    with caplog.at_level(logging.INFO, logger="deepy"):
        rank0.resume(9, 20)  # 0-based 8 is due; 4 and 6 are missing, their weights gone
    assert f"2 save(s) due before step 8 are not in {base} (step-4, step-6)" in caplog.text
    assert (base / "step-8").is_dir()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepy"):  # a run that never wrote here (the key set only now)
        _ranks(tmp_path / "new", every=2)[0].resume(11, 20)
    assert "due before" not in caplog.text and (tmp_path / "new" / "step-10").is_dir()


def test_each_save_says_which_deepy_checkpoint_it_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """issue 42 item 6: Levanter's step-N (0-based) is the model after N + 1 steps, Deepy's global_step{N+1}."""
    keys = HFSaveArgs(hf_save_path=str(tmp_path / "hf"), hf_save_interval=2)
    with caplog.at_level(logging.INFO, logger="deepy"):
        HFSaves(keys, dict, _writer([])).after_step(None, SimpleNamespace(iteration=3))
        HFSaves(keys, dict, _writer([]), ema_beta=0.99).after_step(None, SimpleNamespace(iteration=5))
    assert (f"hf_save_path: wrote {tmp_path / 'hf' / 'step-2'}, the model after 3 steps (Levanter's 0-based step 2):"
            f" the weights of Deepy's global_step3") in caplog.text
    assert (f"hf_save_path: wrote {tmp_path / 'hf' / 'step-4'}, the model after 5 steps (Levanter's 0-based step 4):"
            f" the weight average (ema_beta 0.99) of Deepy's global_step5, not its trained weights") in caplog.text


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_saves_and_atomic_files_follow_the_umask(tmp_path: Path, umask_027: None) -> None:
    """issue 42 item 5: a save's directories and files get what mkdir and open give (0o777/0o666 less the umask),
    as a checkpoint's do, not mkdtemp's and mkstemp's private 0o700/0o600; so do the files written atomically (a
    checkpoint's ``latest`` and commit marker)."""
    import torch
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "tokenizer.json").write_text("{}")
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors 0.8 writes 0o600

    write_whole(tmp_path / "hf" / "step-1", fill)
    atomic_write_text(tmp_path / "latest", "global_step2\n")
    mode = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert mode == {"hf": 0o750, "hf/step-1": 0o750, "hf/step-1/sub": 0o750, "hf/step-1/config.json": 0o640,
                    "hf/step-1/model.safetensors": 0o640, "hf/step-1/sub/tokenizer.json": 0o640, "latest": 0o640}


def test_a_save_that_cannot_be_written_is_one_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A disk that refuses the save (here the writer's OSError, as a full disk raises it) ends the run with one
    message naming the key and the directory, not a traceback of the writer's, and leaves no half-written save."""
    from megatron.errors import CheckpointError

    def full_disk(weights: Any, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    saves = HFSaves(HFSaveArgs(hf_save_path=str(tmp_path), hf_save_interval=2), lambda: {}, full_disk)
    with pytest.raises(CheckpointError, match=r"hf_save_path: writing .*step-2 failed \(OSError: .*No space left"):
        saves.after_step(None, SimpleNamespace(iteration=3))
    assert list(tmp_path.iterdir()) == []


def test_offline_conversions_follow_the_umask_too(tmp_path: Path, umask_027: None) -> None:
    """convert_neox_to_hf.py / convert_hf_to_neox.py write through ``staged_output``: a file a library wrote
    privately (safetensors' 0o600, as ``save_pretrained`` leaves ``model.safetensors``) gets the umask's mode, as
    the saves while training do."""
    from megatron.interop.convert import staged_output

    out = tmp_path / "hf_model"
    with staged_output(out) as staging:
        (staging / "sub").mkdir(mode=0o700)
        private = staging / "sub" / "model.safetensors"
        private.write_bytes(b"weights")
        private.chmod(0o600)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "sub").stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "sub" / "model.safetensors").stat().st_mode) == 0o640


def test_saves_into_a_bucket_are_uploaded_whole_and_found_there_on_resume(s3_server: Any) -> None:
    """Levanter's hf_save_path on a bucket (gs://, here s3:// on a moto server): each step directory is written
    whole locally, uploaded to <base>/step-N/, and removed here; a resumed run finds the last save in the bucket
    and does not write it again."""
    s3_server.bucket("deepy-hf")
    base = "s3://deepy-hf/hf/run-1"
    keys = HFSaveArgs(hf_save_path=base, hf_save_interval=2)
    written: list[str] = []
    saves = HFSaves(keys, lambda: {}, _writer(written))
    _loop(saves, 1, 5)
    assert sorted(s3_server.objects("deepy-hf", "hf/run-1/")) == ["step-2/config.json", "step-4/config.json"]
    assert not any(saves.base.glob("step-*")), "the local copies stay behind"
    again: list[str] = []
    resumed = HFSaves(keys, lambda: {}, _writer(again))
    resumed.resume(5, 5)
    resumed.at_exit(None, SimpleNamespace(iteration=5))
    assert again == []  # step-4, the forced last save, is in the bucket
