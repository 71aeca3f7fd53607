"""``use_comet``: rows logged through the trackers reach a Comet experiment, read back from comet_ml's own offline
archive (no network: ``COMET_START_ONLINE=false``, as a user chooses offline mode).

The names are GPT-NeoX ea7aefd8's: its ``training_log`` logs ``train/<loss key>`` (``train/lm_loss``,
megatron/logging.py:330-338) and its ``evaluate_and_print_results`` ``<chart>/<key>``; its Comet call is
``__internal_api__log_metric__(name, value, framework="gpt-neox", step=iteration)`` (logging.py:586), which
comet_ml records as "Created from: gpt-neox"; the experiment takes comet_workspace, comet_project, then
set_name(comet_experiment_name), add_tags(comet_tags), log_others(comet_others) and the config as parameters
(megatron/neox_arguments/arguments.py:182-211)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from megatron.logging.trackers import TrackerContext, build_trackers
from megatron.neox_arguments.arguments import NeoXArgs

ROWS: list[dict[str, Any]] = [
    {"train/lm_loss": 5.5, "train/lr": 1e-3, "note": "text is skipped"},
    {"train/lm_loss": 5.0, "train/lr": 9e-4, "train/grad_norm": float("nan")},  # NaN: not a plottable number
]


def read_archive(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The one offline archive comet_ml wrote: its experiment.json and its messages, one JSON object a line."""
    (archive,) = directory.glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        experiment = json.loads(z.read("experiment.json"))
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
    return experiment, messages


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """comet_ml offline (its own switches), its archive in ``tmp_path/comet``, its error reports to Sentry off."""
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    return tmp_path / "comet"


def test_rows_reach_an_offline_comet_experiment(offline: Path) -> None:
    cfg = NeoXArgs(use_comet=True, comet_workspace="team", comet_project="unit", comet_experiment_name="tiny run",
                   comet_tags=["deepy", "test"], comet_others={"cluster": "ci"})
    assert [t.type for t in cfg.tracker_settings()] == ["comet"]
    ctx = TrackerContext(rank=0, speaks=True, run_id=None, start_step=0, run_config={"hidden_size": 64,
                                                                                       "optimizer": {"type": "Adam"}})
    trackers = build_trackers(cfg.tracker_settings(), ctx, None)
    for step, row in enumerate(ROWS, start=1):
        trackers.log(row, step)
    trackers.finish()

    experiment, messages = read_archive(offline)
    assert (experiment["workspace"], experiment["project_name"], sorted(experiment["tags"])) == ("team", "unit",
                                                                                                ["deepy", "test"])
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    series = {name: [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == name]
              for name in ("train/lm_loss", "train/lr", "train/grad_norm")}
    assert series == {"train/lm_loss": [(1, 5.5), (2, 5.0)], "train/lr": [(1, 1e-3), (2, 9e-4)], "train/grad_norm": []}
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert others["Name"] == "tiny run" and others["cluster"] == "ci" and others["Created from"] == "gpt-neox"
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"] for m in messages
              if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"}
    assert params == {"hidden_size": 64, "optimizer|type": "Adam"}  # nested keys flattened, as GPT-NeoX asks


def test_only_the_speaking_rank_starts_an_experiment(offline: Path) -> None:
    cfg = NeoXArgs(use_comet=True)
    ctx = TrackerContext(rank=1, speaks=False, run_id=None, start_step=0)
    trackers = build_trackers(cfg.tracker_settings(), ctx, None)
    assert trackers.trackers == [] and not offline.exists()  # GPT-NeoX: ``if self.use_comet and self.rank == 0``
