"""Levanter's hardware-switch workflow and fms-fsdp's train.sh flags, run through ``deepy.py train.py``.

Levanter (docs/Hardware-Agnostic-Training.md): start with ``--config_path``, a checkpointer base path
and the run id on 2 ranks, stop, and resume on 1 rank (and on 2 tensor-parallel ranks) with
``--trainer.load_checkpoint_path <base>/<id> --trainer.wandb.resume true --trainer.id <id>``: the same
(offline) W&B run continues on its step axis, the data fast-forwards with a progress bar, and the loss
curve is the uninterrupted run's. The run stops at the end of ``num_train_steps`` 3 and resumes to 6;
a constant learning rate makes those two commands one schedule.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_parity import free_port
from tests.unit.test_dialects import write_local_data
from tests.unit.tracker_readers import wandb_runs

REPO = Path(__file__).resolve().parents[2]

TINY_LEVANTER = """\
data:
  train_urls: ["{root}/train.{{1..2}}.jsonl"]
  validation_urls: ["{root}/val.jsonl"]
  cache_dir: "{root}/cache"
  tokenizer: "{root}/tokenizer.json"
model:
  type: gpt2
  hidden_dim: 64
  num_heads: 4
  num_layers: 2
  seq_len: 32
  scale_attn_by_inverse_layer_idx: true
trainer:
  mp: p=f32,c=f32
  fsdp_axis: null  # parameters replicated over the data axis (Levanter's default embed is ZeRO-3 here)
  per_device_parallelism: 2
  steps_per_eval: 1000
  max_eval_batches: 1
  wandb:
    project: deepy-levanter
    mode: offline
    save_code: false  # the checkout's ~450 files per launch; save_code is tested in tests/unit/test_trackers.py
optimizer:
  learning_rate: 1e-3
  lr_schedule: constant
  warmup: 0
"""


AVERAGED = ("--trainer.model_averaging.type", "ema", "--trainer.model_averaging.beta", "0.9",
            "--optimizer.skip_bad_steps", "8")
"""Levanter's EMA and skip-step keys, on every run but the tensor-parallel resume (the average is kept per tp
shard and is not re-split: that run leaves it off)."""


def deepy(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp / "xdg")}  # a bucket `save`'s staging: here
    # a launch key goes with any dialect: a flag beside Levanter's/fms-fsdp's, key=value beside GPT-NeoX's
    port = f"master_port={free_port()}" if argv[0].endswith(".yml") else f"--master_port={free_port()}"
    proc = subprocess.run([sys.executable, str(REPO / "deepy.py"), str(REPO / "train.py"), *argv, port], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Path:
    tmp = tmp_path_factory.mktemp("levanter")
    write_local_data(tmp)
    (tmp / "gpt2_tiny.yaml").write_text(TINY_LEVANTER.format(root=tmp))
    # no save schedule given: Levanter's checkpointer saves every 15 minutes and at the end by default
    common = ("--config_path", "gpt2_tiny.yaml", "--trainer.checkpointer.base_path", "out",
              "--trainer.train_batch_size", "8", *AVERAGED)
    deepy(tmp, *common, "--trainer.num_train_steps", "3", "--trainer.id", "run1", "--trainer.log_dir", "logs",
          "--num_gpus", "2")
    # the same step-3 checkpoint, resumed a second way: from a bucket (Levanter's base_path on gs://, here s3://)
    bucket = s3_server.bucket("deepy-levanter")
    for path in sorted(p for p in (tmp / "out").rglob("*") if p.is_file()):
        s3_server.client().upload_file(str(path), bucket, f"out_tp2/{path.relative_to(tmp / 'out')}")
    shutil.copytree(tmp / "out", tmp / "out_neox")  # ... and a third, by a GPT-NeoX config
    tp2 = deepy(tmp, *common[:2], "--trainer.checkpointer.base_path", "s3://deepy-levanter/out_tp2", *common[4:6],
                "--trainer.num_train_steps", "6", "--trainer.wandb.resume", "true", "--trainer.id", "run1",
                "--trainer.log_dir", "logs_tp2", "--trainer.model_axis_size", "2", "--num_gpus", "2")
    resumed = deepy(tmp, *common, "--trainer.num_train_steps", "6", "--trainer.load_checkpoint_path", "out/run1",
                    "--trainer.wandb.resume", "true", "--trainer.id", "run1", "--trainer.log_dir", "logs",
                    "--num_gpus", "1")
    # the uninterrupted run; `epoch: 1` ends it after the one epoch its data holds (6 whole batches), before
    # the 10 steps of its (constant) schedule; at Levanter's default fsdp_axis (embed: ZeRO-3), which the
    # resumed runs are not: its weight average is kept in ZeRO-3's partitions, the others' whole
    ref = deepy(tmp, *common, "--trainer.num_train_steps", "10", "--epoch", "1", "--trainer.id", "ref",
                "--trainer.log_dir", "ref", "--trainer.fsdp_axis", "embed", "--num_gpus", "1")
    for name, proc in (("tp2", tp2), ("resumed", resumed), ("ref", ref)):  # what each run printed
        (tmp / f"{name}.out").write_text(proc.stdout + proc.stderr)
    neox = gpt_neox_config_of(next((tmp / "logs").glob("*/deepy_config.json")))
    # this launch's own choices: steps, where it saves (and its save schedule), logs and ranks
    neox.update(train_iters=6, save="out_neox/run1", load="out_neox/run1", save_interval="15min",
                log_dir="logs_neox", num_gpus=1)
    (tmp / "neox.yml").write_text(json.dumps(neox))
    deepy(tmp, "neox.yml")
    return tmp


def gpt_neox_config_of(resolved_file: Path) -> dict:
    """The GPT-NeoX keys a Levanter run resolved to (each key it set), read from its deepy_config.json."""
    resolved = json.loads(resolved_file.read_text())
    return {key: resolved["args"][key] for key, source in resolved["provenance"].items()
            if source != "derived" and "." not in key}


def test_resumed_on_other_hardware_the_curve_is_the_uninterrupted_one(switched: Path) -> None:
    resumed, reference = losses(switched / "logs"), losses(switched / "ref")
    assert sorted(resumed) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for step in reference:  # steps 4-6 read the batches after the first 3: the data fast-forwarded
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), step
    assert (switched / "out" / "run1").is_dir()  # Levanter's <base_path>/<run id>


def test_the_weight_average_and_the_skip_window_resume_exactly(switched: Path) -> None:
    """ema_beta and skip_bad_steps_window across the 2 -> 1 rank resume: the step-6 average (evaluated and saved)
    and the rule's window are the uninterrupted run's - a ZeRO-3 run, whose average is evaluated in its partitions
    and saved whole, in the file format of the runs without ZeRO."""
    import torch

    def evals(log_dir: Path) -> dict[str, float]:
        rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
        return next(row for row in rows if "eval/ema/lm_loss" in row and row["iteration"] == 6)

    layouts = {run: re.findall(r"^ *layout .*$", (switched / f"{run}.out").read_text(), re.MULTILINE)
               for run in ("ref", "resumed")}
    assert "ZeRO 3;" in layouts["ref"][0] and "ZeRO 3;" not in layouts["resumed"][0], layouts
    resumed, reference = evals(switched / "logs"), evals(switched / "ref")
    assert resumed["eval/ema/lm_loss"] == pytest.approx(reference["eval/ema/lm_loss"], abs=1e-5)
    assert abs(reference["eval/ema/lm_loss"] - reference["eval/lm_loss"]) > 1e-3  # the average, not the weights
    ema = {name: torch.load(switched / "out" / name / "global_step6" / "deepy_ema" / "tp00_pp00.pt")["average"]
           for name in ("run1", "ref")}
    assert ema["run1"].keys() == ema["ref"].keys()
    for key, tensor in ema["ref"].items():
        torch.testing.assert_close(ema["run1"][key], tensor, atol=1e-5, rtol=0)
    windows = {name: json.loads((switched / "out" / name / "global_step6" / "deepy_meta.json").read_text())
               ["extra"]["train_state"]["bad_steps"] for name in ("run1", "ref")}
    assert windows["run1"]["losses"] == pytest.approx(windows["ref"]["losses"], abs=1e-5)
    assert len(windows["ref"]["losses"]) == 6 and windows["ref"]["skipped"] == 0
    rows = [json.loads(line) for line in next((switched / "ref").glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [row["train/skipped_bad_steps"] for row in rows if "train/lm_loss" in row] == [0] * 6  # logged each step


def test_resumed_with_tensor_parallelism_from_a_bucket_the_curve_is_the_same(switched: Path, s3_server: Any) -> None:
    """The step-3 checkpoint of 2 data-parallel ranks, in a bucket named by Levanter's checkpointer.base_path,
    resumed on model_axis_size 2 (tp2); its checkpoints go back into the bucket."""
    stored = s3_server.objects("deepy-levanter", "out_tp2/run1/")  # <base_path>/<run id>
    assert stored["latest"] == b"global_step6\n" and "global_step6/COMMITTED" in stored
    resumed, reference = losses(switched / "logs_tp2"), losses(switched / "ref")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), step


def test_epoch_ends_the_run_when_its_data_is_used_up(switched: Path) -> None:
    """``epoch: 1`` with num_train_steps 10: Levanter's EpochDataset ends the loader after one epoch
    (data/dataset.py:548-556@9263f81e) and the loop stops there (trainer.py:423-428). One epoch here is
    the 2 x 20 documents of 40 words + an end-of-text token = 1640 tokens, (1640 - 1) // 32 = 51 samples
    of 33 tokens: 6 whole batches of 8."""
    tokens = 2 * 20 * (40 + 1)
    steps = ((tokens - 1) // 32) // 8
    assert sorted(losses(switched / "ref")) == list(range(1, steps + 1)) == [1, 2, 3, 4, 5, 6]
    assert "6 steps (1-6, the data's 1 epochs are used up (max_train_epochs))" in (switched / "ref.out").read_text()


def eval_rows(log_dir: Path) -> list[dict]:
    return [row for line in (log_dir / "metrics.jsonl").read_text().splitlines()
            if "eval/lm_loss" in (row := json.loads(line))]


def test_evaluation_reads_levanters_number_of_examples(switched: Path) -> None:
    """max_eval_batches 1 x per_device_eval_parallelism (-1: per_device_parallelism 2) x the data axis
    (train_lm.py:179-181, trainer.py:808-810,954-961@9263f81e): 4 examples on 2 ranks, 2 on 1, whatever
    the accumulation (train_batch_size 8 is 2 or 4 micro-batches per step here)."""
    assert [row["eval/examples"] for row in eval_rows(switched / "logs")] == [1 * 2 * 2, 1 * 2 * 1]
    assert [row["eval/examples"] for row in eval_rows(switched / "ref")] == [1 * 2 * 1]


def test_a_levanter_run_resumes_from_a_gpt_neox_config(switched: Path) -> None:
    """Checkpoints and deepy_config.json hold the resolved GPT-NeoX arguments: a GPT-NeoX config made
    from them resumes the Levanter run's step-3 checkpoint onto the same curve."""
    resumed, reference = losses(switched / "logs_neox"), losses(switched / "ref")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), step


@pytest.mark.parametrize("run", ["resumed", "tp2"])
def test_the_resumed_run_shows_the_data_fast_forward(switched: Path, run: str) -> None:
    """Levanter's guide: a resumed run fast-forwards through its data with a progress bar. Ours is a
    seek: the bar (a line, as the output is not a terminal) over the 3 skipped global batches is full
    at once; rank 0 alone prints it, and a run that starts fresh skips nothing and prints none."""
    out = (switched / f"{run}.out").read_text()
    bars = re.findall(r"^data fast-forward: 3/3 global batches \(100%\) \| [\d,.]+ global batches/s \| done in 0s$",
                      out, re.MULTILINE)
    assert len(bars) == 1, out[-3000:]
    assert "data: resuming at sample 24 " in out  # 3 steps of 8 samples
    assert "fast-forward" not in (switched / "ref.out").read_text()


def test_the_same_wandb_run_continues(switched: Path) -> None:
    runs = wandb_runs(switched / "logs")
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id == "run1"
    assert runs[0].project == "deepy-levanter"
    assert [s for s, _ in runs[0].series("train/lm_loss")] == [1, 2, 3]
    assert [s for s, _ in runs[1].series("train/lm_loss")] == [4, 5, 6]


TRAIN_SH_FLAGS = """\
--use_dummy_dataset=False
--ckpt_load_path=/lustre/pretrain/ckpt
--ckpt_save_path=/lustre/pretrain/ckpt
--data_path=/lustre/bluepile-processing/rel0_7/tokens/llama2/high_quality_rerun_fuzzy_deduped
--fsdp_activation_checkpointing=False
--selective_checkpointing=1
--sharding_strategy=hsdp
--low_cpu_fsdp=False
--batch_size=2
--report_interval=200
--checkpoint_interval=20000
--use_torch_compile=False
--use_profiler=False
"""
"""MODEL_ARGS of fms-fsdp's scripts/train.sh (foundation-model-stack/fms-fsdp 5a296afe), as written."""

DEFAULT_DATASETS = ("lang=en/dataset=commoncrawl,lang=en/dataset=webhose,lang=en/dataset=github_clean,"
                    "lang=de/dataset=wikipedia,lang=es/dataset=wikipedia,lang=fr/dataset=wikipedia,"
                    "lang=ja/dataset=wikipedia,lang=pt/dataset=wikipedia,lang=en/dataset=wikimedia,"
                    "lang=en/dataset=uspto,lang=en/dataset=pubmedcentral,lang=en/dataset=arxiv,"
                    "lang=en/dataset=stackexchange").split(",")
"""train_config.datasets' default: train.sh names none, so these directories are read under data_path."""


def test_fms_train_sh_flags_run(tmp_path: Path, s3_server: Any) -> None:
    """scripts/train.sh's flags with a bucket for its /lustre paths (data and checkpoints in object storage), on the
    13 default datasets: 12 directories of arrow token shards and one pre-tokenized dataset (``.bin``/``.idx``, what
    the README's prepare_data.py writes), their ids up to 8191 (the pydocs tokenizer's 8192 tokens); 2 ranks with
    hsdp; llama_tiny (8192 embedding rows) for 2 steps of 32 tokens. fms-fsdp reads token ids without a tokenizer,
    so the dry run bounds them by the variant's rows (it refused them against the 512 tokens of a stand-in
    tokenizer: issue 42 item 11). The data is downloaded once into the cache; tests/unit/test_remote_data.py shows
    it gives the local files' samples."""
    from tests.unit.test_fms_dialect import write_arrow_shard, write_token_dataset

    data = tmp_path / "tokens"
    for i, name in enumerate(DEFAULT_DATASETS[:-1]):
        write_arrow_shard(data / name / "shard-0.arrow",
                          [[(613 * j + 7 * i + d) % 8191 + 1 for j in range(40)] for d in range(4)])
    write_token_dataset(data / DEFAULT_DATASETS[-1], [[(331 * j + d) % 8191 + 1 for j in range(39)] + [8191, 0]
                                                      for d in range(4)])
    bucket = s3_server.bucket("deepy-fms")
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        s3_server.client().upload_file(str(path), bucket, f"tokens/{path.relative_to(data)}")
    flags = (TRAIN_SH_FLAGS.replace("/lustre/pretrain/ckpt", "s3://deepy-fms/ckpt")
             .replace("/lustre/bluepile-processing/rel0_7/tokens/llama2/high_quality_rerun_fuzzy_deduped",
                      "s3://deepy-fms/tokens")
             .split())
    deepy(tmp_path, *flags, "--model_variant=llama_tiny", "--num_steps=2", "--seq_length=32", "--report_interval=1",
          "--checkpoint_interval=2", "--mixed_precision=False", f"--tracker_dir={tmp_path}/logs", "--num_gpus=2")
    steps = losses(tmp_path / "logs")
    assert sorted(steps) == [1, 2] and all(8.0 < loss < 10.0 for loss in steps.values())  # ln(8192) = 9.01
    stored = s3_server.objects(bucket, "ckpt/checkpoints/")  # Checkpointer's <ckpt_save_path>/checkpoints
    assert stored["latest"] == b"global_step2\n" and "global_step2/COMMITTED" in stored
    assert len(list((tmp_path / "cache" / "shards").glob("shards_*_text_document.idx"))) == 12
