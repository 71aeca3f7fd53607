"""What a run shows about itself, end to end through ``deepy.py`` on 2 CPU ranks (gloo).

One training of a tiny untied model (dummy data, ZeRO-1, dp2) is stopped at step 3 and resumed
to step 6, with W&B (offline), TensorBoard, DeepSpeed's timers, every ``log_*`` statistic and the
torch profiler on, and W&B saving a directory's code (``wandb_code_dir``). Read back with the libraries'
own readers:

- TensorBoard event files and the W&B offline run hold the same scalars as metrics.jsonl; the
  resumed launch logs to the *same* W&B run id and continues its step axis (4, 5, 6);
- the per-parameter gradient norms add up (in squares) to DeepSpeed's global gradient norm, and the
  embedding rows of tokens that never occur have exactly-zero gradients;
- the API key in the environment appears in no output and no file; DeepSpeed's INFO lines do not
  appear (the plot tool is tested on the quick start's run, tests/e2e/test_quick_start.py, and on
  LM/SFT/DPO runs, tests/unit/test_plot_metrics.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from tracker_readers import tensorboard_scalars, wandb_runs  # noqa: E402

pytestmark = pytest.mark.slow

SECRET = "obs-test-key-" + "7" * 27  # 40 characters, the shape of a W&B API key

MODEL = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "max_position_embeddings": 32, "pos_emb": "rotary", "no_weight_tying": True,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4, "precision": "fp32", "train_iters": 6, "lr_decay_iters": 6,
    "eval_interval": 1000, "eval_iters": 1, "log_interval": 1, "use_dummy_dataset": True,
    "tokenizer_type": "CharLevelTokenizer", "num_gpus": 2, "zero_optimization": {"stage": 1},
    "seed": 1234, "num_workers": 0,
}  # fmt: skip

OBSERVE = {
    "log_dir": "logs", "use_wandb": True, "wandb_project": "deepy-e2e", "tensorboard_dir": "tb",
    "wall_clock_breakdown": True, "log_param_norm": True, "log_grad_norm": True, "log_grad_pct_zeros": True,
    "log_optimizer_states": True, "profile": True, "profile_step_start": 2, "profile_step_stop": 3,
    "save": "ckpt", "load": "ckpt", "checkpoint_factor": 3,
    "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
    "wandb_code_dir": "code",  # relative: the launching directory's, made absolute before launch
}  # fmt: skip


def deepy(tmp: Path, config: dict, *extra: str) -> subprocess.CompletedProcess[str]:
    path = tmp / "run.json"
    path.write_text(json.dumps({**config, "master_port": free_port()}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline",
           "WANDB_API_KEY": SECRET, "PYTHONPATH": str(REPO), "GIT_COMMIT": "e2e0c0de",
           "WANDB_DATA_DIR": str(tmp / "wandb-data")}  # the code artifact's staged copy, not in ~/.local
    for name in ("DEEPY_DEBUG", "WANDB_SAVE_CODE", "WANDB_DISABLE_CODE"):
        env.pop(name, None)
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), str(REPO / "train.py"), str(path), *extra],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("observe")
    (tmp / "code").mkdir()
    (tmp / "code" / "experiment.py").write_text("print('the code saved with the run')\n")
    first = deepy(tmp, {**MODEL, **OBSERVE, "exit_interval": 3})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = deepy(tmp, {**MODEL, **OBSERVE})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return tmp, first.stdout + first.stderr + second.stdout + second.stderr


def metric_rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


def train_rows(tmp: Path) -> dict[int, dict]:
    return {row["iteration"]: row for row in metric_rows(tmp) if "train/lm_loss" in row}


def test_wandb_resumes_the_same_run_and_step_axis(resumed_run: tuple[Path, str]) -> None:
    tmp, _ = resumed_run
    runs = wandb_runs(tmp / "logs")
    assert len(runs) == 2  # one offline directory per launch
    assert runs[0].run_id == runs[1].run_id and runs[0].project == "deepy-e2e"
    assert [s for s, _ in runs[0].series("train/lm_loss")] == [1, 2, 3]
    assert [s for s, _ in runs[1].series("train/lm_loss")] == [4, 5, 6]
    rows = train_rows(tmp)
    for run in runs:
        for step, loss in run.series("train/lm_loss"):
            assert loss == pytest.approx(rows[step]["train/lm_loss"], rel=1e-9)
        assert all(step in rows for step, _ in run.series("timers/forward_ms"))
    assert runs[0].config["hidden_size"] == 64  # the resolved arguments are the run's config
    # wandb_code_dir: rank 0's run of each launch saves the directory's source and records $GIT_COMMIT
    for run in runs:
        assert [(kind, paths) for kind, _, paths in run.artifacts] == [("code", ["experiment.py"])]
        assert run.config["git_commit"] == run.git_commit == "e2e0c0de"


def test_tensorboard_holds_the_logged_scalars(resumed_run: tuple[Path, str]) -> None:
    tmp, _ = resumed_run
    scalars = tensorboard_scalars(tmp / "tb")
    rows = train_rows(tmp)
    got = dict(scalars["train/lm_loss"])
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(got[s] == pytest.approx(rows[s]["train/lm_loss"], rel=1e-6) for s in got)
    for key in ("train/lr", "throughput/tokens_per_sec", "throughput/samples_per_sec", "timers/forward_ms",
                "timers/backward_ms", "timers/backward_allreduce_ms", "timers/optimizer_ms", "timers/data_ms",
                "train/param_norm", "train/grad_pct_zeros", "eval/lm_loss"):
        assert key in scalars, key


def test_statistics_agree_with_deepspeeds_global_norm(resumed_run: tuple[Path, str]) -> None:
    tmp, _ = resumed_run
    for step, row in train_rows(tmp).items():
        per_param = [v for k, v in row.items() if k.startswith("grad_norm/")]
        assert len(per_param) >= 20, step
        # ZeRO-1 partitions the gradients over the two ranks; the full ones were assembled
        assert math.sqrt(sum(v * v for v in per_param)) == pytest.approx(row["train/grad_norm"], rel=1e-5)
        params = [v for k, v in row.items() if k.startswith("param_norm/")]
        assert math.sqrt(sum(v * v for v in params)) == pytest.approx(row["train/param_norm"], rel=1e-9)
        # dummy tokens cover 256 of the 512 padded vocabulary rows: the rest get no gradient at all
        assert row["grad_pct_zeros/embedding.word_embeddings.weight"] >= 49.0
        assert row["grad_pct_zeros/layers.0.attention.dense.weight"] == 0.0
        assert row["optimizer_state/exp_avg_norm"] > 0 and row["optimizer_state/exp_avg_sq_norm"] > 0
        assert any(k.startswith("optimizer_state/exp_avg_sq/") for k in row)


def test_profiler_traces_in_the_tensorboard_directory(resumed_run: tuple[Path, str]) -> None:
    tmp, out = resumed_run
    traces = sorted((tmp / "tb").glob("rank*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("ProfilerStep" in str(e.get("name", "")) for e in events)
    assert "profile written to" in out


def test_console_is_ours_and_the_key_never_shows(resumed_run: tuple[Path, str]) -> None:
    tmp, out = resumed_run
    assert "[INFO]" not in out  # DeepSpeed's runner/launcher INFO lines are off by default
    assert "| ETA " in out  # not a terminal: one line per log_interval, with the ETA
    assert "data: resuming at sample 24" in out
    assert SECRET not in out
    leaked = [str(p) for p in tmp.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


def test_comms_logger_summary_is_printed_after_the_last_step(resumed_run: tuple[Path, str]) -> None:
    """DeepSpeed times the collectives it issues (ZeRO-1's gradient reduction over the two ranks); Deepy prints
    its summary after each launch's last step, on one rank (issue 30: passed to DeepSpeed, never shown)."""
    _, out = resumed_run
    assert out.count("Comm. Op") == 2, out[-3000:]  # one table per launch (stopped at 3, resumed to 6)
    table = out[out.index("Comm. Op"):]
    assert "Total Latency(ms)" in table and any(op in table for op in ("all_reduce", "reduce_scatter", "all_gather"))


STATS = {"log_dir": "logs", "log_param_norm": True, "log_grad_norm": True, "log_grad_pct_zeros": True,
         "log_optimizer_states": True, "train_iters": 2, "lr_decay_iters": 2, "wall_clock_breakdown": True}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """The same two steps with the model split over tensor (tp2) and pipeline (pp2) ranks."""
    out = {}
    for name, layout in {"tp2": {"model_parallel_size": 2, "zero_optimization": {"stage": 0}},
                         "pp2": {"pipe_parallel_size": 2, "zero_optimization": {"stage": 1}}}.items():
        tmp = tmp_path_factory.mktemp(name)
        proc = deepy(tmp, {**MODEL, **STATS, **layout})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = train_rows(tmp)
    return out


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_statistics_cover_the_whole_split_model(layout: str, split_runs: dict[str, dict[int, dict]]) -> None:
    for step, row in split_runs[layout].items():
        grads = [v for k, v in row.items() if k.startswith("grad_norm/")]
        # every shard (tp) and every stage (pp) is counted, each once
        assert math.sqrt(sum(v * v for v in grads)) == pytest.approx(row["train/grad_norm"], rel=1e-5), step
        params = [v for k, v in row.items() if k.startswith("param_norm/")]
        assert math.sqrt(sum(v * v for v in params)) == pytest.approx(row["train/param_norm"], rel=1e-9)
        embedding = [v for k, v in row.items() if k.startswith("grad_pct_zeros/") and "word_embeddings" in k]
        assert len(embedding) == 1 and embedding[0] >= 49.0
        assert row["optimizer_state/exp_avg_norm"] > 0
    # DeepSpeed's pipeline timers: the waits for activations and gradients between the stages
    if layout == "pp2":
        for row in split_runs[layout].values():
            assert {"timers/pipe_send_output_ms", "timers/pipe_recv_grad_ms", "timers/forward_ms"} <= set(row)
    # the same model and data on both layouts: the same full-model norms (parity within 1e-5)
    tp2, pp2 = split_runs["tp2"], split_runs["pp2"]
    for step in tp2:
        assert tp2[step]["train/param_norm"] == pytest.approx(pp2[step]["train/param_norm"], rel=1e-5)
        assert tp2[step]["optimizer_state/exp_avg_sq_norm"] == pytest.approx(
            pp2[step]["optimizer_state/exp_avg_sq_norm"], rel=1e-4)
