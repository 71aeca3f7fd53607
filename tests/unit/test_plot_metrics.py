"""tools/plot_metrics.py on an LM -> SFT -> DPO sequence of runs written as training writes them: one
folder per run with its metrics.jsonl and deepy_config.json (issue 32: readable titles and legends, one
axis per kind of loss, panels only for what the runs logged)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from tools import plot_metrics


def write_run(log_dir: Path, name: str, args: dict, rows: list[dict], provenance: dict | None = None) -> None:
    run = log_dir / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {"format": "deepy-resolved-config", "version": 1, "args": args, "provenance": provenance or {}}
    (run / "deepy_config.json").write_text(json.dumps(config))


def lm_rows(n: int, extra: dict | None = None) -> list[dict]:
    rows = [{"iteration": i, "train/lm_loss": 9.0 - 0.01 * i, "train/lr": 1e-3, "train/grad_norm": 0.5,
             "throughput/tokens_per_sec": 5000.0, **(extra or {})} for i in range(10, n + 1, 10)]
    return rows + [{"iteration": n, "eval/lm_loss": 8.0}]


@pytest.fixture()
def three_runs(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    files = {"configs/tiny.yml": "", "configs/local_setup.yml": ""}
    write_run(logs, "20260101-100000-aaaa", {"train_impl": "normal", "config_files": files}, lm_rows(200))
    write_run(logs, "20260101-110000-bbbb", {"train_impl": "normal", "config_files": files,
                                             "train_label_data_paths": ["data/sft_label_document"]}, lm_rows(100))
    dpo = [{"iteration": i, "train/lm_loss": math.log(2) - 0.002 * i, "train/rewards/accuracy": 0.5 + 0.002 * i,
            "train/rewards/margin": 0.01 * i, "train/lr": 1e-3, "throughput/tokens_per_sec": 3000.0}
           for i in range(10, 201, 10)]
    dpo.append({"iteration": 200, "eval/lm_loss": 0.3, "eval/rewards/accuracy": 0.9, "eval/rewards/margin": 1.9})
    write_run(logs, "20260101-120000-cccc", {"train_impl": "dpo", "config_files": {
        **files, "data/pydocs_pref/dpo.yml": ""}}, dpo)
    return logs


def test_each_run_is_named_by_its_objective_and_configs_not_its_timestamp(three_runs: Path) -> None:
    runs = plot_metrics.read_runs(three_runs)
    assert [run.label for run in runs] == ["LM: tiny", "SFT: tiny", "DPO: tiny+dpo"]
    assert [run.objective for run in runs] == ["lm", "sft", "dpo"]
    assert plot_metrics.title(runs) == "LM: tiny, SFT: tiny, DPO: tiny+dpo"  # short: no paths


def test_one_axis_per_kind_of_loss_and_panels_only_for_what_was_logged(three_runs: Path) -> None:
    runs = plot_metrics.read_runs(three_runs)
    fig = plot_metrics.build_figure(runs)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["cross-entropy loss (nats per token)", "DPO loss (per pair; ln 2 = 0.693 at the start)",
                      "preference accuracy", "reward margin", "learning rate", "gradient norm (before clipping)",
                      "tokens / s (all devices)"]  # no fp16 loss scale panel: no run logged one
    cross_entropy = {line.get_label() for line in fig.axes[0].get_lines()}
    assert cross_entropy == {"LM: tiny · train", "LM: tiny · eval", "SFT: tiny · train", "SFT: tiny · eval"}
    dpo_loss = fig.axes[1].get_lines()
    assert {line.get_label() for line in dpo_loss} == {"DPO: tiny+dpo · train", "DPO: tiny+dpo · eval"}
    assert max(max(line.get_ydata()) for line in dpo_loss) < 0.7  # no cross-entropy value on the DPO axis
    assert fig.axes[2].get_lines()[-1].get_ydata()[-1] == pytest.approx(0.9)  # eval preference accuracy


def test_runs_sharing_a_label_are_told_apart_by_their_overrides(tmp_path: Path) -> None:
    files = {"configs/tiny.yml": ""}
    for name, lr in (("20260101-100000-aaaa", 1e-3), ("20260101-110000-bbbb", 3e-3)):
        write_run(tmp_path / "logs", name, {"train_impl": "normal", "config_files": files, "lr": lr}, lm_rows(20),
                  provenance={"lr": "cli"})
    runs = plot_metrics.distinguish(plot_metrics.read_runs(tmp_path / "logs"))
    assert [run.label for run in runs] == ["LM: tiny lr=0.001", "LM: tiny lr=0.003"]


def test_a_run_without_its_config_is_read_from_what_it_logged(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "train/lm_loss": 0.69,
                                                   "train/rewards/accuracy": 0.5}) + "\n")
    [read] = plot_metrics.read_runs(run)
    assert read.objective == "dpo" and read.label == "DPO: old"


def test_the_png_is_written(three_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "curves.png"
    assert plot_metrics.main([str(three_runs), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"wrote {out} (7 panels, 3 runs: LM: tiny, SFT: tiny, DPO: tiny+dpo)\n"


def test_the_readmes_sft_dpo_plot_draws_those_runs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 item 18: ``plot_metrics.py logs`` drew every run of logs/, the other commands' runs too. The
    README's command (read from README.md) names the quick start's, the SFT and the DPO run by their ``save``."""
    from tools.bench.readme_figures import README, post_training

    command = next(c for c in post_training(README.read_text()) if "tools/plot_metrics.py" in c)
    files = {"configs/tiny.yml": "", "configs/local_setup.yml": ""}
    logs = tmp_path / "logs"  # as the README's commands leave it: the quick start's run, then others
    write_run(logs, "20260101-100000-aaaa", {"train_impl": "normal", "config_files": files, "save": "checkpoints"},
              lm_rows(200))
    write_run(logs, "20260101-103000-abab", {"train_impl": "normal", "config_files": files, "seed": 7,
                                             "save": "checkpoints_seed7"}, lm_rows(200), provenance={"seed": "cli"})
    write_run(logs, "20260101-110000-bbbb", {"train_impl": "normal", "config_files": files, "save": "checkpoints_sft",
                                             "train_label_data_paths": ["data/sft_label_document"]}, lm_rows(100))
    write_run(logs, "20260101-113000-baba", {"train_impl": "normal", "config_files": files, "lora_r": 8,
                                             "save": "checkpoints_lora"}, lm_rows(200), provenance={"lora_r": "cli"})
    dpo = [{"iteration": 10, "train/lm_loss": 0.6, "train/rewards/accuracy": 0.6, "train/rewards/margin": 0.1}]
    write_run(logs, "20260101-120000-cccc", {"train_impl": "dpo", "save": "checkpoints_dpo", "config_files": {
        **files, "data/pydocs_pref/dpo.yml": ""}}, dpo)
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert plot_metrics.main(shlex.split(command)[2:]) == 0
    assert capsys.readouterr().out.endswith("3 runs: LM: tiny, SFT: tiny, DPO: tiny+dpo)\n")


def test_a_save_no_run_wrote_is_refused(three_runs: Path) -> None:
    from megatron.errors import UsageError

    with pytest.raises(UsageError, match="--save checkpoints_dpo: no run of these logs saved into it"):
        plot_metrics.main([str(three_runs), "--save", "checkpoints_dpo", "-o", "x.png"])
