"""``eval_tasks`` inside training: lm-eval task metrics at every evaluation, equal to ``eval.py`` on the
same checkpoint, logged as ``lm_eval/<task>/<metric>``, and the training curve unchanged.

The tasks are the local task YAMLs over a local jsonl that ``test_generate.py`` uses for ``eval.py``
(no download: the harness reads them through ``datasets`` offline). The run is the parity suite's tiny
model; with dropout on, a run with tasks and one without must take identical steps (the harness seeds
the global generators; the trainer puts every stream back).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from test_generate import write_tasks
from test_parity import BASE_CONFIG, LAYOUTS, assert_close, deepy, free_port, load_golden

pytestmark = pytest.mark.slow

TASKS = ("deepy_ll", "deepy_roll", "deepy_gen")
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    return [str(root / task) for task in write_tasks(root)]


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


def launch(tmp: Path, script: str = "train.py", **config: Any) -> list[dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    full = {**BASE_CONFIG, "log_dir": str(tmp / "logs"), "master_port": free_port(), **config}
    if script == "train.py":
        proc = deepy(full, tmp)
    else:
        import os
        import subprocess
        import sys

        from test_parity import REPO

        (tmp / "config.json").write_text(json.dumps(full))
        proc = subprocess.run([sys.executable, "deepy.py", script, str(tmp / "config.json")], cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


def task_rows(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    return {r["iteration"]: {k: v for k, v in r.items() if k.startswith("lm_eval/")} for r in rows
            if any(k.startswith("lm_eval/") for k in r)}


def losses(rows: list[dict[str, Any]]) -> list[float]:
    return [r["train/lm_loss"] for r in rows if "train/lm_loss" in r]


@pytest.fixture(scope="module")
def with_tasks(tasks: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("with_tasks")
    rows = launch(tmp, **LAYOUTS["single"], **DROPOUT, eval_tasks=tasks, save=str(tmp / "ckpt"), checkpoint_factor=5)
    return {"rows": rows, "ckpt": tmp / "ckpt"}


def test_task_metrics_are_logged_at_every_evaluation(with_tasks: dict[str, Any]) -> None:
    by_step = task_rows(with_tasks["rows"])
    assert sorted(by_step) == [5, 10]  # eval_interval 5, train_iters 10
    for metrics in by_step.values():
        for name in ("lm_eval/deepy_ll/acc", "lm_eval/deepy_ll/perplexity", "lm_eval/deepy_roll/bits_per_byte",
                     "lm_eval/deepy_roll/word_perplexity", "lm_eval/deepy_gen/exact_match"):
            assert math.isfinite(metrics[name]), (name, metrics)
    # the model trained between the two evaluations
    assert by_step[5]["lm_eval/deepy_roll/bits_per_byte"] != by_step[10]["lm_eval/deepy_roll/bits_per_byte"]


def test_training_curve_is_the_run_without_tasks(with_tasks: dict[str, Any], tmp_path: Path) -> None:
    """Dropout draws from the generators the harness reseeds: identical steps prove they were restored."""
    without = launch(tmp_path, **LAYOUTS["single"], **DROPOUT)
    assert not task_rows(without)
    assert losses(with_tasks["rows"]) == losses(without)
    assert [r["eval/lm_loss"] for r in with_tasks["rows"] if "eval/lm_loss" in r] == \
        [r["eval/lm_loss"] for r in without if "eval/lm_loss" in r]


def test_task_metrics_equal_eval_py_on_the_same_checkpoint(with_tasks: dict[str, Any], tasks: list[str],
                                                           tmp_path: Path) -> None:
    rows = launch(tmp_path, "eval.py", **LAYOUTS["single"], **DROPOUT, eval_tasks=tasks,
                  load=str(with_tasks["ckpt"]), iteration=5, eval_results_prefix=str(tmp_path / "r"))
    offline = task_rows(rows)
    assert sorted(offline) == [5]
    # the row went to the metrics file of the run that wrote the checkpoint (its name is in the checkpoint)
    meta = json.loads((with_tasks["ckpt"] / "global_step5" / "deepy_meta.json").read_text())
    assert (tmp_path / "logs" / meta["extra"]["train_state"]["run_name"] / "metrics.jsonl").is_file()
    inside = task_rows(with_tasks["rows"])[5]
    assert offline[5].keys() == inside.keys()
    for name, value in offline[5].items():
        assert inside[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_tasks_under_zero3_leave_the_parity_curve(tasks: list[str], tmp_path: Path) -> None:
    """ZeRO-3 gathers every weight for each forward: all data-parallel ranks score every request."""
    rows = launch(tmp_path, **LAYOUTS["dp2_zero3"], eval_tasks=tasks)
    assert_close("dp2_zero3 with eval_tasks", "train/lm_loss", losses(rows), load_golden()["train/lm_loss"], 1e-5)
    by_step = task_rows(rows)
    assert sorted(by_step) == [5, 10]
    assert all(math.isfinite(v) for metrics in by_step.values() for v in metrics.values())
