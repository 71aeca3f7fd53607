"""What the console says: the run's header and summary, one line per logged row, one copy of each
error of a multi-rank run, and no third-party noise at the default level (issue 32)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megatron.errors import ConfigError, run_guarded
from megatron.logging import rank_errors
from megatron.logging.log import format_row
from megatron.logging.run_summary import RunFacts, RunOutcome, header_lines, split_size, summary_lines

REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()

FACTS = dict(run_name="20260101-120000-ab12", metrics_dir="logs/20260101-120000-ab12", parameters=624_384,
             non_embedding_parameters=100_096, trainable_parameters=624_384, adapters=False, engine="pipeline",
             world_size=2, dp=2, tp=1, pp=1, cp=1, zero_stage=0, precision="fp32", micro_batch=4, accumulation=1,
             global_batch=8, seq_length=128, tokens_per_step=1024, train_iters=200, start_iteration=0,
             samples_at_end=1_600, tokens_at_end=204_800,
             split_tokens=377_415, split_documents=3_299, eval_interval=100, eval_iters=5, save="checkpoints")


def test_header_states_batch_tokens_steps_epochs_and_parameters() -> None:
    lines = header_lines(RunFacts(**FACTS))
    text = "\n".join(lines)
    assert lines[0] == "run 20260101-120000-ab12: metrics and config in logs/20260101-120000-ab12/"
    assert "624,384 parameters (100,096 without embeddings), all trainable" in text
    assert "2 ranks: data 2 x tensor 1 x pipeline 1; ZeRO 0; fp32" in text
    # 8 x 128 = 1024 tokens per step; 200 steps = 204,800 tokens over a 377,415-token split
    assert "8 sequences x 128 tokens = 1,024 tokens per step (4 per rank x 1 accumulation x 2 data-parallel)" in text
    assert f"200 steps, 204,800 tokens = {200 * 1024 / 377_415:.2f} epochs of the train split" in text
    assert "evaluation every 100 steps (5 batches); checkpoints in checkpoints/" in text


def test_header_of_a_lora_run_and_a_resumed_one() -> None:
    lora = header_lines(RunFacts(**{**FACTS, "trainable_parameters": 8_192, "adapters": True, "start_iteration": 150,
                                    "split_tokens": None, "save": None, "metrics_dir": None}))
    text = "\n".join(lora)
    assert f"8,192 trainable (LoRA adapters, {100 * 8192 / 624_384:.2f}%)" in text
    assert "200 steps (resuming after step 150: 50 to go)" in text
    # unpacked data: a sample is one document
    assert f"= {200 * 8 / 3_299:.2f} epochs of the train split (3,299 documents, one per sample)" in text
    assert "no checkpoints (save is not set)" in text
    # no log_dir (a config without local_setup.yml): the header says no metrics file is written (issue 42, item 18)
    assert lora[0] == "run 20260101-120000-ab12: no metrics.jsonl (log_dir is not set)"
    # DPO: a sample is a pair, two sequences of seq_length
    dpo = "\n".join(header_lines(RunFacts(**{**FACTS, "rows_per_sample": 2, "tokens_per_step": 2048})))
    assert "8 samples (16 sequences) x 128 tokens = 2,048 tokens per step" in dpo


def test_a_resume_with_another_micro_batch_states_the_tokens_read_and_to_read() -> None:
    """Issue 42 item 18: 200 steps of 1,024 tokens, then resumed to 220 steps at micro batch 8 (2,048 tokens per
    step): 200 x 1,024 + 20 x 2,048 = 245,760 tokens at the end, not 220 x 2,048 = 450,560. The header reads the
    checkpoint's consumed samples and tokens and adds the steps to go (``pretrain.py``)."""
    resumed = header_lines(RunFacts(**{**FACTS, "micro_batch": 8, "global_batch": 16, "tokens_per_step": 2048,
                                       "train_iters": 220, "start_iteration": 200,
                                       "samples_at_end": 200 * 8 + 20 * 16, "tokens_at_end": 200 * 1024 + 20 * 2048}))
    text = "\n".join(resumed)
    assert "220 steps (resuming after step 200: 20 to go), 245,760 tokens = " in text, text
    assert f"= {245_760 / 377_415:.2f} epochs of the train split" in text
    unpacked = "\n".join(header_lines(RunFacts(**{**FACTS, "split_tokens": None, "train_iters": 220,
                                                 "start_iteration": 200, "samples_at_end": 1_920})))
    assert f"= {1_920 / 3_299:.2f} epochs of the train split (3,299 documents, one per sample)" in unpacked


def test_split_size_reads_packed_unpacked_and_blended_splits() -> None:
    import numpy as np

    class Split:
        def __init__(self, sizes: list[int], pack_impl: str = "packed") -> None:
            self.sizes, self.pack_impl = np.asarray(sizes), pack_impl

    class Blend:
        datasets = [Split([3, 4]), Split([10])]

    class Wrapped:
        inner = Split([5, 5, 5], "unpacked")

    assert split_size(Split([3, 4])) == (7, 2)
    assert split_size(Blend()) == (17, 3)
    assert split_size(Wrapped()) == (None, 3)
    assert split_size(object()) == (None, None)  # dummy data


def test_summary_states_time_tokens_speed_losses_and_where_things_are(tmp_path: Path) -> None:
    save = tmp_path / "checkpoints"
    save.mkdir()
    (save / "latest").write_text("global_step200")
    row = {"train/lm_loss": 6.28981, "eval/lm_loss": 6.29077, "train/lr": 3e-4}
    outcome = RunOutcome(first_iteration=0, last_iteration=200, stop_reason="train_iters reached", wall_seconds=40.0,
                         tokens=204_800, world_size=2, flops_per_token=6e6, peak_tflops=None, last_row=row,
                         save=str(save), metrics_file="logs/r/metrics.jsonl")
    lines = summary_lines(outcome)
    assert lines[0] == "done: 200 steps (1-200, train_iters reached) in 40s: 204,800 tokens, 5,120 tokens/s on average"
    assert lines[1:] == ["  last        train loss 6.2898, eval loss 6.2908", f"  checkpoint  {save / 'global_step200'}",
                         "  metrics     logs/r/metrics.jsonl"]
    # MFU where the peak is known: 5,120 tokens/s over 2 devices x 6 MFLOP per token / 1 TFLOP/s peak
    with_peak = summary_lines(replace(outcome, peak_tflops=1.0))
    assert with_peak[0].endswith(f"5,120 tokens/s, MFU {5120 / 2 * 6e6 / 1e12:.1%} on average")


def test_rows_print_skipped_steps_only_when_steps_can_be_skipped_and_tflops_at_one_precision() -> None:
    bf16 = format_row({"iteration": 10, "train/lm_loss": 6.0, "train/skipped_steps": 0,
                       "throughput/tflops_per_device": 0.0157}, 200)
    fp16 = format_row({"iteration": 10, "train/lm_loss": 6.0, "train/skipped_steps": 2, "train/loss_scale": 1024.0,
                       "throughput/tflops_per_device": 0.00909}, 200)
    assert "skipped" not in bf16 and "skipped 2" in fp16
    assert "TFLOP/s 0.016" in bf16 and "TFLOP/s 0.009" in fp16  # not 0.0157 then 0.00909


def failing_rank(run_dir: Path, rank: int, error: Exception, capsys: pytest.CaptureFixture[str]) -> str:
    def main() -> int:
        raise error

    with pytest.raises(SystemExit):
        run_guarded(main, [], report=rank_errors.RankErrorReport(run_dir, rank))
    return capsys.readouterr().err


def test_an_error_every_rank_hits_is_printed_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = [failing_rank(tmp_path, rank, ConfigError("bad value for lr_decay_iters"), capsys) for rank in range(4)]
    assert said[0] == "deepy: config error: bad value for lr_decay_iters\n"
    assert said[1:] == ["", "", ""]  # recorded, not printed
    assert rank_errors.summary(tmp_path) == [f"deepy: ranks 0, 1, 2, 3 failed with the error above (host {HOST})"]


def test_different_errors_are_each_said_once_with_their_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failing_rank(tmp_path, 1, ConfigError("the data split is empty"), capsys)
    failing_rank(tmp_path, 0, RuntimeError("Connection closed by peer"), capsys)
    failing_rank(tmp_path, 2, RuntimeError("Connection closed by peer"), capsys)
    lines = rank_errors.summary(tmp_path)
    assert lines[:2] == [f"deepy: rank 1 failed with the error above (host {HOST})",
                         f"deepy: also on ranks 0, 2 (host {HOST}): RuntimeError: Connection closed by peer"]
    assert lines[2].endswith("errors/rank<N>.json")  # where the tracebacks are
    rank_errors.clear(tmp_path)
    assert rank_errors.summary(tmp_path) == []  # the next launch of a resumed run starts clean


def test_an_earlier_launchs_claim_does_not_silence_this_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where srun/mpirun start one deepy.py per rank, nobody clears the directory between launches."""
    failing_rank(tmp_path, 0, ConfigError("last week"), capsys)
    first = tmp_path / "errors" / "first"
    os.utime(first, (first.stat().st_atime - 3600, first.stat().st_mtime - 3600))
    assert failing_rank(tmp_path, 1, ConfigError("today"), capsys) == "deepy: config error: today\n"
    assert failing_rank(tmp_path, 0, ConfigError("today"), capsys) == ""  # this launch's claim holds


def test_a_rank_killed_first_is_the_cause_and_its_peers_errors_follow(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 item 4: rank 0 killed by SIGKILL (its launcher saw it running last at t0), then rank 1's
    collective fails (recorded after t0): rank 0 and its host are the cause, rank 1's error follows it,
    with the memory estimate beside the SIGKILL. An error recorded before the death stays the cause."""
    t0 = time.time()
    time.sleep(0.01)
    failing_rank(tmp_path, 1, RuntimeError("Connection closed by peer [127.0.0.1]:1234"), capsys)
    rank_errors.record_exit(tmp_path, 0, 4242, -signal.SIGKILL, t0)
    lines = rank_errors.summary(tmp_path, memory="memory estimate 37.41 GiB per rank")
    assert lines[0] == (f"deepy: rank 0 on host {HOST} (pid 4242) failed first: killed (out of memory?) by signal 9 "
                        f"(SIGKILL); memory estimate 37.41 GiB per rank")
    assert lines[1] == (f"deepy: then, most likely as a consequence, on rank 1 (host {HOST}): RuntimeError: "
                        f"Connection closed by peer [127.0.0.1]:1234 (printed above)")
    assert not any("failed with the error above" in line for line in lines)

    later = tmp_path / "later"
    failing_rank(later, 1, ConfigError("the data split is empty"), capsys)
    rank_errors.record_exit(later, 0, 4243, -signal.SIGSEGV, time.time())  # died after rank 1's own error
    lines = rank_errors.summary(later, memory="memory estimate 37.41 GiB per rank")
    assert lines == [f"deepy: rank 1 failed with the error above (host {HOST})",
                     f"deepy: also: rank 0 on host {HOST} (pid 4243) killed by signal 11 (SIGSEGV)"]


def test_a_rank_that_cannot_record_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert failing_rank(blocked, 3, ConfigError("x"), capsys) == "deepy: config error: x\n"


def test_accelerator_warning_is_hidden_unless_verbose() -> None:
    """DeepSpeed logs 'Setting accelerator to CPU' on import on a machine without a GPU: in every tool,
    --help included. Importing megatron first (every entry point does) filters it."""
    code = ("import logging, megatron; log = logging.getLogger('DeepSpeed'); log.addHandler(logging.StreamHandler()); "
            "log.warning('Setting accelerator to CPU. If you have GPU or other accelerator...'); log.warning('kept')")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    loud = subprocess.run([sys.executable, "-c", code, "--verbose"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert quiet.stderr == "kept\n"
    assert loud.stderr.startswith("Setting accelerator to CPU") and loud.stderr.endswith("kept\n")


def test_other_ranks_log_errors_only(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.logging.log import setup_logging

    logger = setup_logging(speaks=False)
    module = logging.getLogger("megatron.data.build")
    logger.info("a row")
    module.warning("valid split has no data")  # the speaking rank says it; N ranks would repeat it
    assert capsys.readouterr().out == ""
    setup_logging(speaks=True)
    logger.info("a row")
    module.warning("valid split has no data")
    module.info("module detail")  # --verbose only
    assert capsys.readouterr().out == "a row\nvalid split has no data\n"
    setup_logging(speaks=False, verbose=True)
    module.warning("valid split has no data")
    assert capsys.readouterr().out == "valid split has no data\n"
    setup_logging(speaks=True)


def test_launch_line_hides_our_per_node_launcher_unless_verbose() -> None:
    from megatron.launcher.plan import LaunchPlan
    from megatron.launcher.run import launch_line

    plan = LaunchPlan(argv=["python", "-u", "-m", "megatron.launcher.local_ranks", "--slots=0,1"], env={},
                      world_size=2, mode="local", master_addr="127.0.0.1", master_port=29500,
                      config_path="logs/r/deepy_config.json")
    assert launch_line(plan) == "deepy: starting 2 ranks on this machine (rendezvous 127.0.0.1:29500)"
    assert launch_line(plan, verbose=True).endswith(": python -u -m megatron.launcher.local_ranks --slots=0,1")


def test_resolved_config_names_the_run_and_its_one_directory(tmp_path: Path) -> None:
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import run_directory

    args = NeoXArgs(log_dir="logs")
    assert run_directory(args, run_name="20260101-120000-ab12") == Path("logs/20260101-120000-ab12")
    assert run_directory(NeoXArgs(log_dir="logs", run_dir="elsewhere"), run_name="x") == Path("elsewhere")
    assert json.dumps(str(run_directory(NeoXArgs(), run_name="x"))) == '"runs/x"'


def test_progress_bars_are_drawn_by_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's bars came from every rank: ranks other than 0 switch tqdm off before importing it."""
    from megatron.logging.console import quiet_other_ranks

    for name in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    quiet_other_ranks(0)
    assert "TQDM_DISABLE" not in os.environ
    quiet_other_ranks(1)
    code = "import tqdm, io; s = io.StringIO(); [None for _ in tqdm.tqdm(range(3), file=s)]; print(repr(s.getvalue()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ}).stdout
    assert out.strip() == "''"  # tqdm honours it: nothing drawn


def test_a_preprocessed_prefix_is_named_when_data_path_misses_its_suffix(tmp_path: Path) -> None:
    """preprocess_data.py --output-prefix data/mine writes data/mine_text_document.*; data_path=data/mine
    said "not found" with no hint (issue 32)."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.neox_arguments.file_checks import _written_by_preprocess

    builder = MMapIndexedDatasetBuilder(str(tmp_path / "mine_text_document.bin"), np.uint16)
    builder.add_item(np.arange(4))
    builder.end_document()
    builder.finalize(str(tmp_path / "mine_text_document.idx"))
    assert _written_by_preprocess(str(tmp_path / "mine")) == [str(tmp_path / "mine_text_document")]
    assert _written_by_preprocess(str(tmp_path / "other")) == []


@pytest.mark.parametrize(("tp", "pp"), [(1, 0), (2, 0), (1, 1), (2, 2)])
def test_a_converted_models_yaml_names_the_zero_stages_its_layout_takes(tp: int, pp: int) -> None:
    """Issue 32: the converter's deepy_model.yml said "ZeRO stage 0-2 work" for pp2, which refuses ZeRO-2."""
    from test_config_rules import ok, problems

    from megatron.interop.yaml_config import zero_stages

    low, high = (int(n) for n in zero_stages(tp, pp).split("-"))
    world = tp * max(pp, 1)
    layout = {"model_parallel_size": tp, "pipe_parallel_size": pp}
    for stage in range(low, high + 1):
        ok(world=world, **layout, zero_optimization={"stage": stage})
    if high < 3:
        assert "ZeRO stage" in problems(world=world, **layout, zero_optimization={"stage": high + 1})
