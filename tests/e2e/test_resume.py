"""Resume end to end through ``deepy.py``: exact continuation, fine-tuning, clear load errors.

A tiny model on dummy data, 2 CPU ranks. "Exact" means: 12 steps straight and 6 steps + save +
new processes + resume + 6 steps give the same loss at every step (fp32, within 1e-6), with
dropout on so the RNG streams must be restored too. The helpers here are shared by the other
checkpoint e2e tests (``test_resume_layout.py``, ``test_crash_safety.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch_helpers import survivors
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

MODEL_YML = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
norm: layernorm
pos_emb: rotary
optimizer: {type: Adam, params: {lr: 0.001, betas: [0.9, 0.95], eps: 1.0e-8}}
min_lr: 0.0001
lr_decay_style: cosine
warmup: 0.1
train_batch_size: 8
gradient_clipping: 1.0
weight_decay: 0.0
attention_dropout: 0.0
precision: fp32
train_iters: 12
lr_decay_iters: 12
eval_interval: 1000
eval_iters: 1
seed: 1234
num_workers: 0
log_interval: 1
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
"""


def write_config(tmp: Path) -> Path:
    path = tmp / "model.yml"
    path.write_text(MODEL_YML)
    return path


def deepy(
    tmp: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 400,
    script: Path = REPO / "train.py", umask: int = -1,
) -> subprocess.CompletedProcess[str]:
    """``deepy.py SCRIPT model.yml key=value...`` in ``tmp`` (SCRIPT: train.py); output captured. ``umask``: the
    launch's (-1: this process's)."""
    config = tmp / "model.yml"
    if not config.exists():
        write_config(tmp)
    run_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    run_env.pop("DEEPY_DEBUG", None)
    if not any(o.startswith("master_port=") for o in overrides):
        # deepy.py's own pick is the kernel's ephemeral choice, which the other xdist worker's gloo
        # connections draw from too (one collided: EADDRINUSE); tests/ports.py's ranges lie below it
        overrides = (*overrides, f"master_port={free_port()}")
    return subprocess.run(
        [sys.executable, str(REPO / "deepy.py"), str(script), str(config), *overrides],
        cwd=tmp, env=run_env, capture_output=True, text=True, timeout=timeout, umask=umask,
    )  # fmt: skip


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}


def lrs(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["iteration"]: row["train/lr"] for row in rows if "train/lr" in row}


def assert_curves_match(got: dict[int, float], want: dict[int, float], tol: float) -> None:
    assert got, "no losses logged"
    missing = sorted(set(got) - set(want))
    assert not missing, f"steps {missing} not in the reference"
    bad = {s: (got[s], want[s]) for s in got if abs(got[s] - want[s]) > tol * max(1.0, abs(want[s]))}
    assert not bad, f"loss differs at steps {bad}"


DP2 = ("num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=1", "zero_optimization={stage: 1}")


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("reference")
    proc = deepy(tmp, *DP2, "hidden_dropout=0.1", "log_dir=logs")
    assert proc.returncode == 0, output(proc)
    return losses(tmp / "logs")


RESUME = (*DP2, "hidden_dropout=0.1", "save=ckpt", "load=ckpt", "checkpoint_factor=6")


@pytest.fixture(scope="module")
def first_half(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1-6 of the dropout run, stopped after saving at step 6 (each test resumes a copy)."""
    tmp = tmp_path_factory.mktemp("first_half")
    first = deepy(tmp, *RESUME, "exit_interval=6", "log_dir=logs1")
    assert first.returncode == 0, output(first)
    return tmp


def resume_copy(first_half: Path, tmp_path: Path, change: Callable[[Path], None] | None = None) -> dict[int, float]:
    shutil.copytree(first_half / "ckpt", tmp_path / "ckpt")
    if change is not None:
        change(tmp_path / "ckpt" / "global_step6")
    second = deepy(tmp_path, *RESUME, "log_dir=logs2")
    assert second.returncode == 0, output(second)
    resumed = losses(tmp_path / "logs2")
    assert min(resumed) == 7 and max(resumed) == 12  # continued, not restarted
    return resumed


def test_exact_resume_matches_the_uninterrupted_run(tmp_path: Path, first_half: Path,
                                                    dropout_reference: dict[int, float]) -> None:  # fmt: skip
    assert (first_half / "ckpt" / "latest").read_text().strip() == "global_step6"
    resumed = resume_copy(first_half, tmp_path)
    assert_curves_match(losses(first_half / "logs1"), dropout_reference, 1e-6)
    assert_curves_match(resumed, dropout_reference, 1e-6)
    # the checkpoint carries the config files and the resolved arguments
    meta = json.loads((tmp_path / "ckpt" / "global_step12" / "deepy_meta.json").read_text())
    assert meta["iteration"] == 12 and meta["consumed_samples"] == 96
    assert meta["args"]["hidden_size"] == 64 and MODEL_YML in meta["args"]["config_files"].values()
    # configs/ holds the run's resolved values, key=value overrides included (what GPT-NeoX's tools read)
    resolved = yaml.safe_load((tmp_path / "ckpt" / "global_step12" / "configs" / "resolved.yml").read_text())
    assert resolved["hidden_size"] == 64 and resolved["checkpoint_factor"] == 6
    assert (resolved["pipe_parallel_size"], resolved["model_parallel_size"]) == (1, 1)


def to_earlier_deepy_layout(ckpt: Path, num_layers: int = 2, heads: int = 4) -> None:
    """Rewrite a pipeline checkpoint's model files the way Deepy wrote them before GPT-NeoX's layout
    (test code, from that layout's rules): files numbered by pipeline spec (blocks 1..L, final norm
    L+1), ``final_norm.*``, QKV rows ``[all q; all k; all v]``, ``deepy_meta.json`` format 1."""
    import torch

    def blocks_qkv(t: torch.Tensor) -> torch.Tensor:  # per head [q_h; k_h; v_h] -> [q; k; v]
        d = t.shape[0] // (3 * heads)
        per_head = t.reshape(heads, 3, d, *t.shape[1:])
        return torch.cat([per_head[:, i].reshape(heads * d, *t.shape[1:]) for i in range(3)])

    for path in sorted(ckpt.glob("layer_*-model_*-model_states.pt")):
        index, rest = int(path.name[6:8]), path.name[8:]
        state = torch.load(path, weights_only=False)
        if 2 <= index <= num_layers + 1:
            spec = index - 1
            state = {k: blocks_qkv(v) if "query_key_value" in k else v for k, v in state.items()}
            names = {"mlp.linear1.": "mlp.dense_h_to_4h.", "mlp.linear2.": "mlp.dense_4h_to_h."}  # gelu: no gate
            state = {next((k.replace(a, b) for a, b in names.items() if k.startswith(a)), k): v
                     for k, v in state.items()}
        elif index == num_layers + 3:
            spec = num_layers + 1
            state = {k.replace("norm.", "final_norm.", 1): v for k, v in state.items()}
        else:
            spec = index
        path.unlink()
        torch.save(state, ckpt / f"layer_{spec:02d}{rest}")
    meta = json.loads((ckpt / "deepy_meta.json").read_text())
    (ckpt / "deepy_meta.json").write_text(json.dumps({**meta, "format": 1}))


def test_a_checkpoint_of_the_earlier_deepy_layout_resumes_exactly(tmp_path: Path, first_half: Path,
                                                                   dropout_reference: dict[int, float]) -> None:
    def rewrite(ckpt: Path) -> None:
        to_earlier_deepy_layout(ckpt)
        assert (ckpt / "layer_01-model_00-model_states.pt").is_file()
        assert not (ckpt / "layer_05-model_00-model_states.pt").exists()

    assert_curves_match(resume_copy(first_half, tmp_path, rewrite), dropout_reference, 1e-6)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps without dropout, checkpoints at 3 and 6."""
    tmp = tmp_path_factory.mktemp("saved")
    proc = deepy(tmp, *DP2, "hidden_dropout=0.0", "save=ckpt", "checkpoint_factor=3", "train_iters=6",
                 "lr_decay_iters=6", "log_dir=logs")  # fmt: skip
    assert proc.returncode == 0, output(proc)
    return tmp


def test_finetune_and_initialize_from_load_weights_only(tmp_path: Path, saved_run: Path) -> None:
    ckpt = saved_run / "ckpt"
    fresh = losses(saved_run / "logs")
    fine = deepy(tmp_path, *DP2, f"load={ckpt}", "finetune=true", "save=ft", "checkpoint_factor=3",
                 "train_iters=3", "lr_decay_iters=3", "log_dir=ft_logs")  # fmt: skip
    assert fine.returncode == 0, output(fine)
    assert "loaded model weights only" in output(fine)
    ft = losses(tmp_path / "ft_logs")
    assert sorted(ft) == [1, 2, 3]  # step and schedule start at 0
    # the schedule restarts at 0: GPT-NeoX's warmup at iteration 0 is lr·max(1, 0)/warmup_iter, with
    # warmup_iter = warmup·lr_decay_iters = 0.1·3 (a float: above the peak when under one step)
    assert lrs(tmp_path / "ft_logs")[1] == pytest.approx(0.001 * 1 / (0.1 * 3), rel=1e-6)
    assert abs(ft[1] - fresh[1]) > 1e-3  # the weights came from the checkpoint
    assert (tmp_path / "ft" / "global_step3" / "COMMITTED").exists()

    # restarted with the same settings, the fine-tune continues from its own checkpoint
    again = deepy(tmp_path, *DP2, f"load={ckpt}", "finetune=true", "save=ft", "checkpoint_factor=3",
                  "train_iters=5", "lr_decay_iters=3", "log_dir=ft_logs2")  # fmt: skip
    assert again.returncode == 0, output(again)
    assert "resuming it, not re-initializing" in output(again)
    assert sorted(losses(tmp_path / "ft_logs2")) == [4, 5]

    # initialize_from into a ZeRO-3 (fsdp) run of another layout (plain model, ZeRO-3 instead of a one-stage
    # pipeline at ZeRO-1): the weights come through a universal checkpoint, which ZeRO-3 reads module-only
    init = deepy(tmp_path, "num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=0", "sharding_strategy=fsdp",
                 f"initialize_from={ckpt}", "train_iters=3", "lr_decay_iters=3", "log_dir=init_logs")  # fmt: skip
    assert init.returncode == 0, output(init)
    assert "layout changed from" in output(init) and "Traceback" not in output(init)
    assert_curves_match(losses(tmp_path / "init_logs"), ft, 2e-5)  # another layout sums in another order


def test_load_errors_are_clear(tmp_path: Path, saved_run: Path) -> None:
    ckpt = saved_run / "ckpt"
    missing = deepy(tmp_path, *DP2, f"load={ckpt}", "iteration=5", "log_dir=l1")
    assert missing.returncode == 2, output(missing)
    assert "no committed checkpoint for iteration 5" in output(missing)
    assert "committed iterations: 3, 6" in output(missing)

    # refused before launch, from the arguments the checkpoint recorded (no rank is started)
    shape = deepy(tmp_path, *DP2, f"load={ckpt}", "hidden_size=32", "train_iters=6", "lr_decay_iters=6",
                  "log_dir=l2")  # fmt: skip
    assert shape.returncode == 2, output(shape)
    assert "hidden_size=32 (command line): " in output(shape) and "was saved with hidden_size 64" in output(shape)
    assert "Traceback" not in output(shape) and "rank=" not in output(shape)


def test_iteration_selects_an_older_checkpoint(tmp_path: Path, saved_run: Path) -> None:
    proc = deepy(tmp_path, *DP2, f"load={saved_run / 'ckpt'}", "iteration=3", "train_iters=6", "lr_decay_iters=6",
                 "log_dir=logs")  # fmt: skip
    assert proc.returncode == 0, output(proc)
    resumed = losses(tmp_path / "logs")
    assert sorted(resumed) == [4, 5, 6]
    assert_curves_match(resumed, losses(saved_run / "logs"), 1e-6)


def test_inspect_tool_lists_and_diffs(saved_run: Path) -> None:
    tool = [sys.executable, str(REPO / "tools" / "ckpts" / "inspect_checkpoint.py")]
    ckpt = saved_run / "ckpt"
    shown = subprocess.run([*tool, str(ckpt), "--config"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "global_step6" in text and "iteration         6" in text and "consumed samples  48" in text
    assert "tp=1 pp=1 dp=2 zero_stage=1" in text
    assert "attention.query_key_value.weight" in text and "hidden_size: 64" in text
    same = subprocess.run([*tool, "--diff", str(ckpt / "global_step6"), str(ckpt)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert same.returncode == 0 and same.stdout.strip().endswith("identical"), same.stdout + same.stderr
    differ = subprocess.run([*tool, "--diff", str(ckpt / "global_step3"), str(ckpt / "global_step6")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert "iteration: A 3  B 6" in differ.stdout and "max |A-B|" in differ.stdout


def _rows(log_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["iteration"]: row[key] for row in rows if key in row}


def test_evaluation_after_resume_equals_the_uninterrupted_run_and_a_finished_run_exits_at_once(
    tmp_path: Path,
) -> None:
    """Validation at steps 2, 4, 6 reads the split's 1st, 2nd, 3rd block of batches whether or not the
    run was interrupted at step 3; the test split once at the end; then the finished run starts no rank."""
    common = (*DP2, "train_iters=6", "lr_decay_iters=6", "eval_interval=2", "eval_iters=2", "save=ckpt",
              "load=ckpt", "checkpoint_factor=3")  # fmt: skip
    (tmp_path / "a").mkdir()
    straight = deepy(tmp_path / "a", *common, "log_dir=logs")
    assert straight.returncode == 0, output(straight)
    want_eval, want_test = _rows(tmp_path / "a" / "logs", "eval/lm_loss"), _rows(tmp_path / "a" / "logs", "test/lm_loss")
    assert sorted(want_eval) == [2, 4, 6] and sorted(want_test) == [6]
    assert len(set(want_eval.values())) == 3  # three different blocks of the validation split

    b = tmp_path / "b"
    b.mkdir()
    first = deepy(b, *common, "exit_interval=3", "log_dir=logs")
    assert first.returncode == 0, output(first)
    resumed = deepy(b, *common, "log_dir=logs")
    assert resumed.returncode == 0, output(resumed)
    got_eval, got_test = _rows(b / "logs", "eval/lm_loss"), _rows(b / "logs", "test/lm_loss")
    assert sorted(got_eval) == [2, 4, 6] and sorted(got_test) == [6]  # one run's file, continued
    for step in (2, 4, 6):
        assert abs(got_eval[step] - want_eval[step]) <= 1e-6, (step, got_eval[step], want_eval[step])
    assert abs(got_test[6] - want_test[6]) <= 1e-6
    assert_curves_match(losses(b / "logs"), losses(tmp_path / "a" / "logs"), 1e-6)

    rows_before = (b / "logs" / "metrics.jsonl").read_text()
    again = deepy(b, *common, "log_dir=logs", timeout=120)
    assert again.returncode == 0, output(again)
    assert "already finished at iteration 6" in again.stdout
    assert "starting" not in again.stdout and "rank=" not in output(again)  # no rank was launched
    assert (b / "logs" / "metrics.jsonl").read_text() == rows_before  # nothing logged twice


# --- issue 43: max_restarts and the hang watch restart a failed launch from its last checkpoint --------------------
FAULTS = Path(__file__).with_name("fault_train.py")
RESTARTING = (*DP2, "hidden_dropout=0.1", "save=ckpt", "load=ckpt", "checkpoint_factor=4", "log_dir=logs")


def events(log_dir: Path, kind: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("event") == kind]


def faulty(tmp: Path, faults: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    return deepy(tmp, *RESTARTING, *overrides, script=FAULTS,
                 env={"DEEPY_FAULTS": faults, "DEEPY_FAULT_MARKERS": str(tmp)})  # fmt: skip


def test_a_rank_killed_after_step_10_is_restarted_on_the_uninterrupted_curve(
        tmp_path: Path, dropout_reference: dict[int, float]) -> None:  # fmt: skip
    """kill -9 of rank 1 as step 11 begins (checkpoints every 4 steps): deepy stops rank 0, launches again from
    global_step8, and the run ends with exit 0 on the curve of the run nothing happened to. Rank 1 also waits
    0.15 s for each micro-batch (a slow data loader): a straggler, named, and nothing stops for it."""
    proc = faulty(tmp_path, "kill:1:11,slow:1:0.15", "max_restarts=2", "straggler_window=4")
    said = output(proc)
    assert proc.returncode == 0, said[-4000:]
    assert_curves_match(losses(tmp_path / "logs"), dropout_reference, 1e-6)
    assert sorted(losses(tmp_path / "logs")) == list(range(1, 13))
    (row,) = events(tmp_path / "logs", "restart")
    assert (row["rank"], row["step"], row["restart"], row["max_restarts"]) == (1, 10, 1, 2), row
    assert "killed (out of memory?) by signal 9 (SIGKILL)" in str(row["reason"])
    assert said.count("deepy: restart 1 of 2: rank 1 on host ") == 1, said[-4000:]
    assert "after step 10); resuming from checkpoint ckpt/global_step8 (step 8)" in said
    assert said.count("deepy: starting 2 ranks") == 2
    # the relaunched ranks know: the trackers get resilience/restarts (here metrics.jsonl), the summary says it
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "resilience/restarts" in r] == [9]
    assert re.search(r"^  restarts    1 \(max_restarts; the last after step 10: rank 1 on host ", said, re.MULTILINE)
    assert_straggler_named(said, tmp_path / "logs", rank=1, window=4)
    assert not survivors(tmp_path)


def assert_straggler_named(said: str, log_dir: Path, rank: int, window: int) -> None:
    """The slowed rank is named on the console and in event rows, the log rows carry straggler/*, with the ratio
    computed again from the per-rank means the console states (median of two ranks: their mean)."""
    lines = re.findall(rf"^deepy: straggler: rank {rank} \(host \S+\) took (\d+\.\d)x the median local step time "
                       rf"\((\d+) ms vs (\d+) ms\) over the last {window} steps$", said, re.MULTILINE)
    assert lines, said[-4000:]
    for ratio, slow, median in lines:
        assert abs(float(ratio) - int(slow) / int(median)) <= 0.1 and float(ratio) > 1.5
    rows = events(log_dir, "straggler")
    assert rows and all(r["rank"] == rank and float(str(r["ratio"])) > 1.5 for r in rows)
    logged = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    slowest = [r["straggler/slowest_rank"] for r in logged if "straggler/slowest_rank" in r]
    assert slowest and set(slowest) == {float(rank)}


def test_a_stopped_rank_is_found_hung_its_stacks_written_and_the_run_restarted(
        tmp_path: Path, dropout_reference: dict[int, float]) -> None:  # fmt: skip
    """SIGSTOP of rank 1 as step 11 begins: nothing inside it can notice. Rank 0 waits in the step's collective; its
    hang watch fires after hang_timeout, names rank 1 (whose heartbeat stopped), both ranks' stacks are written
    (the stopped one's through deepy's launcher: SIGUSR2 then SIGCONT), and max_restarts resumes from global_step8."""
    started = time.monotonic()
    proc = faulty(tmp_path, "stop:1:11", "max_restarts=1", "hang_timeout=8s")
    took = time.monotonic() - started
    said = output(proc)
    assert proc.returncode == 0, said[-4000:]
    assert_curves_match(losses(tmp_path / "logs"), dropout_reference, 1e-6)
    (hang,) = events(tmp_path / "logs", "hang")
    (restart,) = events(tmp_path / "logs", "restart")
    assert (hang["rank"], hang["step"], hang["detected_by"]) == (1, 10, 0), hang
    assert restart["rank"] == 1 and restart["step"] == 10, restart
    assert said.count("deepy: hang: rank 1 (host ") == 1, said[-4000:]  # printed once (then quoted by the restart)
    assert "its heartbeat stopped" in said and "rank 0 saw it after 8s in forward/backward" in said
    # detected within hang_timeout + 30 s of the stop: the whole run, both launches included, is bounded by it
    assert float(str(hang["time"])) - os.stat(tmp_path / "fault0-stop-1-11").st_mtime <= 8 + 30
    assert took < 400
    run_dir = (tmp_path / "logs" / "metrics.jsonl").resolve().parent
    stacks = {rank: (run_dir / "hangs" / f"stacks-rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "hang_watch.py" in stacks[0] and "Current thread" in stacks[0]
    assert "fault_train.py" in stacks[1], stacks[1][-2000:]  # where the stopped rank stood: the injected SIGSTOP
    assert not survivors(tmp_path)


def test_the_restart_budget_runs_out_with_the_last_checkpoint_named_and_intact(tmp_path: Path) -> None:
    """Rank 0 killed in step 6 of every launch, max_restarts=1: the relaunch fails at the same step ("no step was
    completed since the last restart"), deepy gives up with the killed rank's code and names global_step4, which a
    launch without the fault then resumes."""
    proc = faulty(tmp_path, "kill!:0:6", "max_restarts=1", "train_iters=8", "lr_decay_iters=8")
    said = output(proc)
    assert proc.returncode == 128 + 9, said[-4000:]
    assert "deepy: restart 1 of 1: rank 0 on host " in said
    assert re.search(r"deepy: giving up after 1 restart \(max_restarts=1\): rank 0 on host \S+ killed \(out of "
                     r"memory\?\) by signal 9 \(SIGKILL\) \(after step 5; no step was completed since the last "
                     r"restart\); the last committed checkpoint is ckpt/global_step4 \(step 4\)", said), said[-4000:]
    assert len(events(tmp_path / "logs", "restart")) == 1
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step4"
    resumed = deepy(tmp_path, *RESTARTING, "train_iters=8", "lr_decay_iters=8")
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resum" in output(resumed) and sorted(losses(tmp_path / "logs"))[-1] == 8


def test_a_run_saving_into_a_bucket_resumes_on_another_machine(tmp_path: Path, s3_server: Any,
                                                               dropout_reference: dict[int, float]) -> None:
    """save=load=s3://... with background saves: the checkpoints reach the bucket (marker and `latest` last), and a
    launch whose staging directory is gone (another node) resumes from the bucket on the uninterrupted curve. Before,
    the same keys trained into a local directory named `s3:/...` and nothing reached the bucket."""
    s3_server.bucket("deepy-e2e")
    url = "s3://deepy-e2e/runs/dropout"
    common = (*DP2, "hidden_dropout=0.1", f"save={url}", f"load={url}", "checkpoint_factor=6", "async_save=true")
    first = deepy(tmp_path, *common, "exit_interval=6", "log_dir=logs1", f"checkpoint_staging_dir={tmp_path / 'node1'}")
    assert first.returncode == 0, output(first)
    assert "writing it in the background" in output(first)
    stored = s3_server.objects("deepy-e2e", "runs/dropout/")
    assert stored["latest"] == b"global_step6\n" and "global_step6/COMMITTED" in stored
    assert not list(tmp_path.glob("s3*")), "a local directory named after the URL"
    shutil.rmtree(tmp_path / "node1")
    second = deepy(tmp_path, *common, "log_dir=logs2", f"checkpoint_staging_dir={tmp_path / 'node2'}")
    assert second.returncode == 0, output(second)
    resumed = losses(tmp_path / "logs2")
    assert min(resumed) == 7 and max(resumed) == 12, resumed
    assert_curves_match(resumed, dropout_reference, 1e-6)
    stored = s3_server.objects("deepy-e2e", "runs/dropout/")
    assert stored["latest"] == b"global_step12\n" and "global_step12/COMMITTED" in stored
    # started again, the finished run reads its bucket before launch and has nothing to do
    third = deepy(tmp_path, *common, "log_dir=logs3", f"checkpoint_staging_dir={tmp_path / 'node3'}")
    assert third.returncode == 0, output(third)
    assert f"already finished at iteration 12 (checkpoint {url}/global_step12)" in output(third)
