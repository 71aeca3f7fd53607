"""What a `load` directory holds, and the message a run stops with when it is not a Deepy checkpoint.

The end-to-end tests (tests/e2e/test_hf_interop.py) check a few of these through real runs (exit
code 2, no traceback, nothing written); here every kind of directory is covered cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import commit, discovery
from megatron.checkpointing.safe_load import load_checkpoint_file, weights_only_loading
from megatron.errors import CheckpointError


def deepy_ckpt(save: Path, step: int, committed: bool = True) -> Path:
    tag = save / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "deepy_meta.json").write_text(json.dumps({"format": 1}))
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    if committed:
        commit.write_commit_marker(tag, commit.CommitInfo(step, "step", 0.0))
        commit.write_latest(save, tag.name)
    return tag


def gpt_neox_save(save: Path, step: int = 143000, pipeline: bool = True) -> Path:
    tag = save / f"global_step{step}"
    tag.mkdir(parents=True)
    name = "layer_00-model_00-model_states.pt" if pipeline else "mp_rank_00_model_states.pt"
    torch.save({}, tag / name)
    (save / "latest").write_text(tag.name)
    return tag


def test_missing_and_empty(tmp_path: Path) -> None:
    assert discovery.inspect_load_dir(tmp_path / "nope").kind == "missing"
    (tmp_path / "empty").mkdir()
    assert discovery.inspect_load_dir(tmp_path / "empty").kind == "empty"
    # DeepSpeed's helper scripts alone are not a checkpoint
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "zero_to_fp32.py").write_text("")
    assert discovery.inspect_load_dir(helpers).kind == "empty"
    message = discovery.explain(discovery.inspect_load_dir(tmp_path / "nope"), 1, 0)
    assert "does not exist" in message and "load_checkpoint: false" in message


def test_committed_deepy_checkpoints_are_found(tmp_path: Path) -> None:
    deepy_ckpt(tmp_path, 4)
    deepy_ckpt(tmp_path, 8, committed=False)
    found = discovery.inspect_load_dir(tmp_path)
    assert found.kind == "deepy" and found.committed == [4] and found.incomplete == ["global_step8"]
    # the resume warning names the interrupted save and the committed one used instead
    tag, warnings = commit.newest_committed(tmp_path)
    assert tag == "global_step4"
    assert "global_step8" in warnings[0] and "the last committed one is global_step4" in warnings[0]


def test_only_incomplete_saves(tmp_path: Path) -> None:
    deepy_ckpt(tmp_path, 6, committed=False)
    found = discovery.inspect_load_dir(tmp_path)
    assert found.kind == "incomplete"
    message = discovery.explain(found, 1, 1)
    assert "global_step6 is incomplete" in message and "no earlier committed one" in message


def test_a_tag_directory_is_not_a_save_directory(tmp_path: Path) -> None:
    tag = deepy_ckpt(tmp_path, 12)
    found = discovery.inspect_load_dir(tag)
    assert found.kind == "deepy_tag"
    assert f"set load: {tmp_path} and iteration: 12" in discovery.explain(found, 1, 1)


@pytest.mark.parametrize("pipeline", [True, False])
def test_gpt_neox_checkpoint_gets_the_converter_command(tmp_path: Path, pipeline: bool) -> None:
    tag = gpt_neox_save(tmp_path / "neox", pipeline=pipeline)
    for path in (tmp_path / "neox", tag):  # the save directory or the tag itself
        found = discovery.inspect_load_dir(path)
        assert found.kind == "gpt_neox" and found.foreign_tag == tag
        message = discovery.explain(found, 2, 4)
        assert "GPT-NeoX (DeeperSpeed) checkpoint" in message
        assert f"python tools/ckpts/convert_hf_to_neox.py {tag} " in message and "--tp 2 --pp 4" in message


def test_hugging_face_directory_and_other_files(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    found = discovery.inspect_load_dir(hf)
    assert found.kind == "hf_model"
    assert "Hugging Face model directory" in discovery.explain(found, 1, 0)

    junk = tmp_path / "junk"
    junk.mkdir()
    for name in ("notes.txt", "weights.bin"):
        (junk / name).write_text("x")
    found = discovery.inspect_load_dir(junk)
    assert found.kind == "other"
    assert "found: notes.txt, weights.bin" in discovery.explain(found, 1, 0)


def test_corrupt_checkpoint_files_are_named(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"a": torch.ones(4)}, good)
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x04not a pickle" * 10)
    for name in ("truncated.pt", "garbage.pt"):
        with pytest.raises(CheckpointError, match=f"checkpoint file {tmp_path / name} is corrupt or truncated"):
            with weights_only_loading(tmp_path / name):
                torch.load(tmp_path / name)
    # the checkpoint's directory given: the unreadable file in it is found and named
    with pytest.raises(CheckpointError, match="truncated.pt is corrupt or truncated|garbage.pt is corrupt"):
        with weights_only_loading(tmp_path):
            torch.load(tmp_path / "truncated.pt")
    assert torch.equal(load_checkpoint_file(good)["a"], torch.ones(4))
    for name in ("truncated.pt", "garbage.pt"):  # our own reads name the file the same way
        with pytest.raises(CheckpointError, match=f"checkpoint file {tmp_path / name} is corrupt or truncated"):
            load_checkpoint_file(tmp_path / name)


class _Marker:
    """Unpickling this writes a file: the stand-in for code a checkpoint must never run."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.write_text, (self.target, "ran"))


def test_pickled_code_is_refused_before_deepspeed_style_loads_run(tmp_path: Path) -> None:
    """DeepSpeed reads with ``torch.load(weights_only=False)``; the files are checked first, so its
    load never sees one holding code, and no process-wide switch (environment variable) is used."""
    ckpt = tmp_path / "global_step2"
    (ckpt / "zero" / "w").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, ckpt / "mp_rank_00_model_states.pt")
    torch.save({"param": torch.ones(2)}, ckpt / "zero" / "w" / "fp32.pt")
    import deepspeed.checkpoint.universal_checkpoint  # noqa: F401 - importing DeepSpeed sets variables of its own
    environment = dict(__import__("os").environ)
    with weights_only_loading(ckpt):
        assert dict(__import__("os").environ) == environment  # TORCH_FORCE_WEIGHTS_ONLY_LOAD untouched
        state = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)  # as DeepSpeed does
    assert torch.equal(state["module"]["w"], torch.ones(2))

    torch.save({"param": torch.ones(2), "payload": _Marker(tmp_path / "pwned")}, ckpt / "zero" / "w" / "exp_avg.pt")
    body_ran = False
    with pytest.raises(CheckpointError, match=r"refusing to load \S*zero/w/exp_avg.pt: it contains pickled objects"):
        with weights_only_loading(ckpt):
            body_ran = True
    assert not body_ran and not (tmp_path / "pwned").exists()
    assert dict(__import__("os").environ) == environment
