"""Progress output (terminal bar vs. one line per log step) and the step timers."""

from __future__ import annotations

import io
import logging
import time

import pytest
from deepspeed.utils.timer import SynchronizedWallClockTimer

from megatron.logging.progress import TrainingProgress, format_duration, phase, progress
from megatron.logging.timers import ENGINE_TIMERS, TimedIterator, Timers


def capture_logger() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger(f"test-progress-{id(stream)}")
    logger.handlers = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 59.4, 61, 3600 + 125)] == ["0s", "59s", "1m01s", "1h02m"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_log_file_gets_one_line_per_log_step_with_eta() -> None:
    logger, stream = capture_logger()
    clock = FakeClock()
    p = TrainingProgress(total=100, start=0, enabled=True, logger=logger, terminal=False, clock=clock, heartbeat_s=0)
    assert p.bar is None
    p.begin()
    for it in range(1, 11):
        clock.now += 1.0
        p.step(it)  # no bar: nothing printed per step
    assert stream.getvalue() == ""
    p.row({"iteration": 10, "train/lm_loss": 5.0, "timers/ms_per_iter": 1000.0})
    line = stream.getvalue().strip()
    # 1 s per step measured after the first step: 90 steps left
    assert line.startswith("iteration 10/100 | loss 5.000000") and line.endswith("| ETA 1m30s")
    p.row({"iteration": 10, "eval/lm_loss": 5.1})  # evaluation rows: no ETA
    assert stream.getvalue().splitlines()[-1] == "iteration 10/100 | eval loss 5.100000"


def test_a_slow_first_step_does_not_throw_the_eta() -> None:
    """Issue 32: a first step that compiles for 79 s promised 5m16s for one second of work. The ETA is
    the rate after the first step; the slow step is named once."""
    logger, stream = capture_logger()
    clock = FakeClock()
    p = TrainingProgress(total=20, start=0, enabled=True, logger=logger, terminal=False, clock=clock, heartbeat_s=0)
    p.begin()
    clock.now = 79.0
    p.step(1)
    for it in range(2, 11):
        clock.now += 0.1
        p.step(it)
    p.row({"iteration": 10, "train/lm_loss": 5.0})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "step 1 took 1m19s (start-up: compilation, first allocations); the ETA counts the steps after it"
    assert lines[1].endswith("| ETA 1s")  # 10 steps x 0.1 s, not 10 x 7.9 s


def test_a_long_first_step_says_it_is_still_running() -> None:
    logger, stream = capture_logger()
    p = TrainingProgress(total=5, start=2, enabled=True, logger=logger, terminal=False, heartbeat_s=0.05)
    p.begin()
    time.sleep(0.3)
    p.step(3)
    p.close()
    beats = [line for line in stream.getvalue().splitlines() if line.startswith("step 3 still running after")]
    assert beats and len(beats) <= 6
    said = len(stream.getvalue().splitlines())
    time.sleep(0.15)
    assert len(stream.getvalue().splitlines()) == said  # the heartbeat stopped with the first step


def test_terminal_gets_a_bar_and_rows_above_it(capsys: pytest.CaptureFixture[str]) -> None:
    logger, stream = capture_logger()
    p = TrainingProgress(total=50, start=10, enabled=True, logger=logger, terminal=True)
    assert p.bar is not None and p.bar.n == 10  # a resumed run starts the bar where it stands
    p.step(11)
    p.row({"iteration": 11, "train/lm_loss": 4.25, "timers/ms_per_iter": 100.0})
    p.close()
    out = capsys.readouterr().out
    assert "training" in out and "11/50" in out and "loss 4.250000" in out
    assert "iteration 11/50 | loss 4.250000" in out and "ETA" not in out.split("iteration 11/50")[1].split("\n")[0]
    assert stream.getvalue() == ""  # written through the bar, not the logger


def test_the_bar_shows_the_loss_of_the_row_above_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 item 18: the bar showed the last step's loss (7.8583) under a row with the mean of the window's
    steps (8.462402), two numbers for "loss" at one step. The bar now shows the row's number, as the row prints it."""
    logger, _ = capture_logger()
    p = TrainingProgress(total=50, start=0, enabled=True, logger=logger, terminal=True, heartbeat_s=0)
    p.begin()
    for it in range(1, 11):
        p.step(it)
    p.row({"iteration": 10, "train/lm_loss": 8.462402, "timers/ms_per_iter": 100.0})
    assert p.bar is not None and p.bar.postfix == "loss 8.462402"
    p.row({"iteration": 10, "eval/lm_loss": 9.5})  # an evaluation row leaves the training loss
    assert p.bar.postfix == "loss 8.462402"
    p.close()
    assert "iteration 10/50 | loss 8.462402" in capsys.readouterr().out


def test_silent_on_ranks_that_do_not_speak(capsys: pytest.CaptureFixture[str]) -> None:
    logger, stream = capture_logger()
    p = TrainingProgress(total=5, start=0, enabled=False, logger=logger, terminal=True)
    p.step(1)
    p.row({"iteration": 1, "train/lm_loss": 1.0})
    p.message("hello")
    assert p.bar is None and stream.getvalue() == "" and capsys.readouterr().out == ""


def test_tool_progress_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    bar = progress(1000, "tokenizing", "doc", stream=out, every_s=0.0, terminal=False)
    bar.update(250)
    bar.set_postfix_str("2.0 MB/s")
    bar.update(750)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tokenizing: 250/1,000 doc (25%)") and "ETA" in lines[0]
    assert lines[-1].startswith("tokenizing: 1,000/1,000 doc (100%)") and "done in" in lines[-1]
    assert lines[-1].endswith("2.0 MB/s")


def test_tool_progress_is_a_tqdm_bar_on_a_terminal() -> None:
    """What a resumed run's data fast-forward (megatron/training/pretrain.py) draws on a terminal."""
    out = io.StringIO()
    with progress(3, "data fast-forward", "global batches", stream=out, terminal=True) as bar:
        bar.update(3)
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("data fast-forward: 100%|") and "| 3/3 [" in last, repr(out.getvalue())


def test_phase_lines() -> None:
    logger, stream = capture_logger()
    with phase(logger, "building sample index", announce_after_s=0):
        pass
    assert stream.getvalue().splitlines() == ["building sample index...", "building sample index: done in 0s"]
    with phase(logger, "a quick one", announce_after_s=5.0):
        pass  # done before it was worth a line: no trace
    with phase(logger, "a slow one", announce_after_s=0.05):
        time.sleep(0.2)
    assert stream.getvalue().splitlines()[2:] == ["a slow one...", "a slow one: done in 0s"]


def test_timed_iterator_and_window_metrics() -> None:
    timers = Timers(breakdown=False)

    def slow() -> object:
        for i in range(3):
            time.sleep(0.02)
            yield i

    it = TimedIterator(slow(), timers)
    start = time.perf_counter()
    assert list(it) == [0, 1, 2]
    elapsed_ms = (time.perf_counter() - start) * 1000
    row = timers.window_metrics(iterations=3)
    # per iteration: at least the sleep, at most what the whole loop took (a loaded machine
    # stretches sleeps, so the upper bound is measured, not assumed)
    assert 20.0 <= row["timers/data_ms"] <= elapsed_ms / 3 + 1.0
    assert timers.window_metrics(1) == {}  # read and reset


class _Engine:
    """DeepSpeed's own timer group, as an engine holds it."""

    def __init__(self) -> None:
        self.timers = SynchronizedWallClockTimer()


def test_engine_timers_become_metrics_and_stop_printing(capsys: pytest.CaptureFixture[str]) -> None:
    engine = _Engine()
    timers = Timers(breakdown=True)
    timers.attach(engine)
    for name in ("fwd", "bwd", "step", "fwd_microstep"):
        engine.timers(name).start()
        time.sleep(0.01)
        engine.timers(name).stop()
    engine.timers.log(["fwd", "bwd"])  # what DeepSpeed calls each step: must neither print nor reset
    assert capsys.readouterr().out == ""
    row = timers.window_metrics(iterations=2)
    assert set(row) == {"timers/forward_ms", "timers/backward_ms", "timers/optimizer_ms"}
    assert all(3.0 < v < 200.0 for v in row.values())  # ~10 ms spread over 2 iterations
    assert timers.window_metrics(1) == {}  # every timer was reset, the micro-step twin too
    assert set(ENGINE_TIMERS.values()) >= {"forward", "backward", "backward_allreduce", "optimizer",
                                           "pipe_send_output", "pipe_recv_grad"}


def test_without_breakdown_the_engine_keeps_its_own_printing() -> None:
    engine = _Engine()
    Timers(breakdown=False).attach(engine)
    assert "log" not in vars(engine.timers)


def test_profiler_records_the_step_range_on_cpu(tmp_path) -> None:
    import json

    import torch

    from megatron.errors import ConfigError
    from megatron.logging.config import ProfileSettings
    from megatron.logging.profiling import StepProfiler

    settings = ProfileSettings(torch_profiler=True, memory_snapshot=False, start=2, stop=3,
                               trace_dir=str(tmp_path / "tb"), memory_dir=str(tmp_path / "mem"))
    profiler = StepProfiler(settings, rank=0, cuda=False)
    x = torch.randn(64, 64)
    for it in range(1, 6):
        profiler.before_step(it)
        x = torch.tanh(x @ x)
        profiler.after_step(it)
    (trace,) = (tmp_path / "tb").glob("rank0*.pt.trace.json")
    steps = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if "ProfilerStep" in str(e.get("name"))}
    assert len(steps) == 2  # steps 2 and 3 (step 1 was the discarded warm-up), nothing else
    assert profiler.written == [str(tmp_path / "tb")]
    snapshot = ProfileSettings(torch_profiler=False, memory_snapshot=True, start=2, stop=3, trace_dir="", memory_dir="")
    with pytest.raises(ConfigError, match="memory_profiling=true needs a GPU"):
        StepProfiler(snapshot, rank=0, cuda=False)
