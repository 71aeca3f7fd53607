"""Trackers in one process: rows logged through :class:`Trackers` land in metrics.jsonl, TensorBoard
event files and a W&B offline run, and are read back with each library's own reader."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tracker_readers import read_wandb_file, tensorboard_scalars, wandb_runs

from megatron import plugins
from megatron.logging.trackers import (TrackerContext, build_trackers, code_settings, new_wandb_run_id, scalars,
                                       source_files)
from megatron.neox_arguments.arguments import NeoXArgs

ROWS = [
    {"train/lm_loss": 5.5, "train/lr": 1e-3, "throughput/tokens_per_sec": 1000.0, "consumed_samples": 8},
    {"train/lm_loss": 5.0, "train/lr": 9e-4, "throughput/tokens_per_sec": 1100.0, "note": "text is skipped"},
    {"eval/lm_loss": 5.2, "train/grad_norm": float("nan")},  # NaN: not a plottable number
]


def test_registry_is_keyed_by_tracker_type() -> None:
    assert set(plugins.names("tracker")) == {"tensorboard", "wandb"}
    assert scalars({"iteration": 3, "a": 1, "b": True, "c": "x", "d": float("inf"), "e": 2.5}) == {"a": 1.0, "e": 2.5}
    ids = {new_wandb_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 8 and i.isalnum() and i.islower() or i.isdigit() for i in ids)


CODE = {"a.py": "x = 1\n", "sub/b.py": "y = 2\n", "requirements.txt": "torch\n", "notes.txt": "not code\n",
        "wandb/skipped.py": "z = 3\n", ".venv/pyvenv.cfg": "home = /usr\n", ".venv/lib/site.py": "w = 4\n"}
"""A project's directory: source, a text file, wandb's own directory, and a virtual environment."""


def code_repository(root: Path) -> str:
    """:data:`CODE` as a git repository that ignores its .venv, plus a new file not committed yet; returns
    the commit."""
    for name, text in {**CODE, ".gitignore": ".venv/\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "code"]):
        subprocess.run(git + command, check=True)
    (root / "new.py").write_text("v = 5\n")
    return subprocess.run(git + ["log", "-1", "--format=%H"], check=True, capture_output=True, text=True).stdout.strip()


def test_all_trackers_receive_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # artifact staging, not ~/.local
    for name in ("GIT_COMMIT", "WANDB_SAVE_CODE", "WANDB_DISABLE_CODE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "code").mkdir()
    commit = code_repository(tmp_path / "code")
    cfg = NeoXArgs(log_dir=str(tmp_path / "logs"), use_wandb=True, wandb_project="unit",
                   tensorboard_dir=str(tmp_path / "tb"), wandb_code_dir=str(tmp_path / "code"))
    ctx = TrackerContext(rank=0, speaks=True, run_id="unit0001", start_step=0, run_config={"hidden_size": 64})
    trackers = build_trackers(cfg.tracker_settings(), ctx, cfg.log_dir)
    assert trackers.wandb_run_id == "unit0001"
    for step, row in enumerate(ROWS, start=1):
        trackers.log(row, step)
    trackers.finish()

    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in lines] == [1, 2, 3]
    assert lines[1]["note"] == "text is skipped" and lines[2]["train/grad_norm"] is None

    tb = tensorboard_scalars(tmp_path / "tb")
    assert [(s, round(v, 6)) for s, v in tb["train/lm_loss"]] == [(1, 5.5), (2, 5.0)]
    assert tb["eval/lm_loss"][0][0] == 3 and "train/grad_norm" not in tb and "note" not in tb

    (run,) = wandb_runs(tmp_path / "logs")
    assert (run.run_id, run.project) == ("unit0001", "unit")
    assert run.config["hidden_size"] == 64
    assert run.series("train/lm_loss") == [(1, 5.5), (2, 5.0)]
    assert run.series("throughput/tokens_per_sec") == [(1, 1000.0), (2, 1100.0)]
    assert run.series("eval/lm_loss") == [(3, 5.2)]
    # wandb_code_dir: wandb's log_code saves the directory's *.py and requirements.txt (not other files, not
    # wandb/, and here not what git ignores) as a "code" artifact; the commit is the repository's HEAD, in the
    # config as Levanter records it (hparams_to_save["git_commit"], tracker/wandb.py:187-188@9263f81e) and in
    # the run record
    ((kind, name, paths),) = run.artifacts
    assert (kind, name.startswith("source-unit-")) == ("code", True)
    assert paths == ["a.py", "new.py", "requirements.txt", "sub/b.py"]
    assert run.config["git_commit"] == run.git_commit == commit
    # wandb saves the installed packages with every run (its x_save_requirements), the list Levanter logs
    # as its own requirements.txt artifact (tracker/wandb.py:230-237@9263f81e)
    assert "requirements.txt" in run.files


def test_code_settings_follow_git_commit_and_wandbs_switches(tmp_path: Path) -> None:
    """$GIT_COMMIT wins over the repository (tracker/wandb.py:269-270@9263f81e); a directory that is not a
    repository's root records no commit (GitPython's Repo(code_dir) there); WANDB_DISABLE_CODE/SAVE_CODE
    leave wandb's save_code to wandb."""
    (tmp_path / "sub").mkdir()
    commit = code_repository(tmp_path)
    root, sub = str(tmp_path), str(tmp_path / "sub")
    assert code_settings(root, {}) == ({"git_root": root, "save_code": True, "git_commit": commit}, commit)
    assert code_settings(root, {"GIT_COMMIT": "c0ffee"})[1] == "c0ffee"
    assert code_settings(sub, {}) == ({"git_root": sub, "save_code": True}, None)
    assert "save_code" not in code_settings(sub, {"WANDB_DISABLE_CODE": "true"})[0]
    assert code_settings(None, {"GIT_COMMIT": "c0ffee"}) == ({}, None)


def test_outside_git_the_code_leaves_out_python_environments(tmp_path: Path) -> None:
    for name, text in CODE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    taken = source_files(str(tmp_path))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    picked = sorted(str(p.relative_to(tmp_path)) for p in files if taken(str(p), str(tmp_path)))
    # wandb/ is left to log_code's own exclude_fn (wandb's exclude_wandb_fn)
    assert picked == ["a.py", "requirements.txt", "sub/b.py", "wandb/skipped.py"]


def test_non_speaking_ranks_track_nothing_unless_wandb_on_all_ranks(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ctx = TrackerContext(rank=1, speaks=False, run_id="unit0002", start_step=0)
    quiet = NeoXArgs(log_dir=str(tmp_path), use_wandb=True, tensorboard_dir=str(tmp_path))
    assert build_trackers(quiet.tracker_settings(), ctx, quiet.log_dir).trackers == []
    every = NeoXArgs(log_dir=str(tmp_path), use_wandb=True, wandb_init_all_ranks=True, wandb_group="grp",
                     wandb_code_dir=str(tmp_path))
    trackers = build_trackers(every.tracker_settings(), ctx, every.log_dir)
    assert trackers.wandb_run_id == "unit0002-rank1"  # its own run in the group, for its system metrics
    trackers.log({"train/lm_loss": 1.0}, 1)  # the loss is logged by rank 0 only
    trackers.finish()
    (path,) = tmp_path.glob("wandb/offline-run-*/run-unit0002-rank1.wandb")
    run = read_wandb_file(path)
    assert run.series("train/lm_loss") == [] and run.artifacts == []  # the code is rank 0's to save


def test_tensorboard_resume_drops_steps_logged_again(tmp_path: Path) -> None:
    cfg = NeoXArgs(tensorboard_dir=str(tmp_path))
    first = build_trackers(cfg.tracker_settings(), TrackerContext(rank=0, speaks=True, run_id=None, start_step=0), None)
    for step in range(1, 7):
        first.log({"train/lm_loss": float(step)}, step)
    first.finish()
    # resumed from a checkpoint at step 4: steps 5 and 6 are logged again with new values
    second = build_trackers(cfg.tracker_settings(), TrackerContext(rank=0, speaks=True, run_id=None, start_step=4), None)
    for step in (5, 6):
        second.log({"train/lm_loss": 10.0 * step}, step)
    second.finish()
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    (run,) = mux.Runs()
    steps = [(e.step, e.value) for e in mux.Scalars(run, "train/lm_loss")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]


def test_wandb_files_follow_the_users_wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_DIR set: wandb's files go there (as wandb users expect), not under log_dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    (tmp_path / "mine").mkdir()
    cfg = NeoXArgs(log_dir=str(tmp_path / "logs"), use_wandb=True, wandb_project="unit")
    ctx = TrackerContext(rank=0, speaks=True, run_id="unit0003", start_step=0, run_config={})
    trackers = build_trackers(cfg.tracker_settings(), ctx, cfg.log_dir)
    trackers.log(ROWS[0], 1)
    trackers.finish()
    (run,) = wandb_runs(tmp_path / "mine")
    assert run.run_id == "unit0003"
    assert not (tmp_path / "logs" / "wandb").exists()
    assert (run.artifacts, "git_commit" in run.config) == ([], False)  # no wandb_code_dir: no code, no commit
    assert "requirements.txt" in run.files  # the installed packages, saved by wandb with every run
