"""What makes a resumed run indistinguishable from an uninterrupted one, without launching ranks:
evaluation positions, the finished-run check of deepy.py, and one metrics file per run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron.app.deepy import already_finished
from megatron.checkpointing import commit
from megatron.logging.metrics import METRICS_FILE, MetricsWriter, run_files
from megatron.logging.trackers import new_run_name
from megatron.neox_arguments.loading import load_config
from megatron.training.evaluate import evaluation_number

from metrics_rows import read_metrics


def test_each_evaluation_reads_its_own_block_of_the_split() -> None:
    # eval_interval 2, train_iters 5: evaluations at 2, 4 and the final one at 5
    assert [evaluation_number(i, 2) for i in (2, 4, 5)] == [0, 1, 2]
    # a run ending on a multiple evaluates once there, as the 3rd evaluation
    assert evaluation_number(6, 2) == 2
    # no periodic evaluation: only the final one, from the start of the split
    assert evaluation_number(7, None) == 0 and evaluation_number(7, 0) == 0


def _checkpoint(save: Path, step: int, args: dict[str, object], committed: bool = True) -> None:
    tag = save / commit.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "deepy_meta.json").write_text(json.dumps({"format": 1, "iteration": step, "args": args}))
    if committed:
        commit.write_commit_marker(tag, commit.CommitInfo(step, "step", 0.0))
        commit.write_latest(save, tag.name)


def _resolved(tmp: Path, *overrides: str):  # noqa: ANN202 - a ResolvedConfig
    (tmp / "model.yml").write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n"
                                   "max_position_embeddings: 32\nuse_dummy_dataset: true\n"
                                   "tokenizer_type: CharLevelTokenizer\n")
    return load_config([str(tmp / "model.yml")], list(overrides))


def test_a_finished_run_is_recognised_from_its_checkpoint(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _checkpoint(save, 4, {"train_iters": 8})
    _checkpoint(save, 8, {"train_iters": 8})
    done = already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8"), "train.py")
    assert done is not None and done.startswith("already finished at iteration 8") and "global_step8" in done
    # more steps asked for, an older checkpoint chosen, fine-tuning, no load, or not training: it runs
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=12"), "train.py") is None
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8", "iteration=4"), "train.py") is None
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8", "finetune=true"), "train.py") is None
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8", "load_checkpoint=false"),
                            "train.py") is None
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8"), "generate.py") is None
    # an interrupted save of a later step does not count; the committed step 8 does
    _checkpoint(save, 9, {"train_iters": 9}, committed=False)
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_iters=9"), "train.py") is None


def test_a_finished_run_whose_last_save_was_killed_is_launched_to_write_it(tmp_path: Path) -> None:
    """A run killed inside its forced last HF (or PEFT) save, after its last checkpoint was committed, has a save
    left to write: deepy.py launches it (the ranks write it from that checkpoint: StepSaves.resume) and says so;
    once the save is there, the run is finished."""
    save = tmp_path / "ckpt"
    _checkpoint(save, 8, {"train_iters": 8})
    hf = tmp_path / "hf"
    resolved = _resolved(tmp_path, f"load={save}", "train_iters=8", f"hf_save_path={hf}", "hf_save_interval=5")
    assert already_finished(resolved, "train.py") is None
    assert [w for w in resolved.warnings if "already finished" in w] == [
        f"already finished at iteration 8 (checkpoint {save / 'global_step8'}), but its last save hf_save_path: "
        f"{hf / 'step-7'} is missing (a run killed while writing it): launching to write it from that checkpoint"]
    (hf / "step-7").mkdir(parents=True)
    done = already_finished(_resolved(tmp_path, f"load={save}", "train_iters=8", f"hf_save_path={hf}"), "train.py")
    assert done is not None and done.startswith("already finished at iteration 8")


def test_train_epochs_uses_the_derived_last_step_of_the_same_epochs(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _checkpoint(save, 30, {"train_iters": 30, "train_epochs": 2})
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_epochs=2"), "train.py") is not None
    assert already_finished(_resolved(tmp_path, f"load={save}", "train_epochs=3"), "train.py") is None


def test_each_run_has_its_own_file_and_a_resume_drops_what_it_relogs(tmp_path: Path) -> None:
    first, other = "20250101-000000-aaaa", "20250102-000000-bbbb"
    with MetricsWriter.for_run(tmp_path, first) as w:
        for step in (1, 2, 3, 4):
            w.write({"iteration": step, "train/lm_loss": 10.0 - step})
        w.write({"iteration": 4, "eval/lm_loss": 5.0})
    # killed after step 4 with the last checkpoint at 3 (a torn last line included): a resume at 3
    with open(tmp_path / first / METRICS_FILE, "a") as f:
        f.write('{"iteration": 5, "train/lm_lo')
    with MetricsWriter.for_run(tmp_path, first, resume_from=3) as w:
        w.write({"iteration": 4, "train/lm_loss": 6.5})
    lines = (tmp_path / first / METRICS_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # the torn line is gone
    assert [(r["iteration"], r["train/lm_loss"]) for r in rows] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.5)]
    assert os.readlink(tmp_path / METRICS_FILE) == f"{first}/{METRICS_FILE}"

    # another run sharing the log_dir: a file of its own; the link follows the newest run
    with MetricsWriter.for_run(tmp_path, other) as w:
        w.write({"iteration": 1, "train/lm_loss": 1.0})
    assert read_metrics(tmp_path) == [{"iteration": 1, "train/lm_loss": 1.0}]
    assert run_files(tmp_path) == [tmp_path / first / METRICS_FILE, tmp_path / other / METRICS_FILE]
    assert len(read_metrics(tmp_path / first)) == 4


def test_a_metrics_file_from_before_runs_had_folders_is_kept(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"iteration": 1}\n')
    with MetricsWriter.for_run(tmp_path, "r") as w:
        w.write({"iteration": 1, "x": 2.0})
    assert (tmp_path / METRICS_FILE).read_text() == '{"iteration": 1}\n' and not (tmp_path / METRICS_FILE).is_symlink()
    assert run_files(tmp_path) == [tmp_path / "r" / METRICS_FILE]


def test_run_names_sort_by_start_time() -> None:
    early, late = new_run_name(1_700_000_000), new_run_name(1_700_000_061)
    assert early < late and len(early.split("-")) == 3
