"""metrics.jsonl rows and throughput arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.logging.log import format_row
from megatron.logging.metrics import METRICS_FILE, MetricsWriter
from megatron.logging.throughput import as_metrics, measure, peak_tflops

from metrics_rows import read_metrics, series


def test_writer_appends_plain_json_rows(tmp_path) -> None:
    with MetricsWriter(tmp_path) as w:
        w.write({"iteration": 1, "train/lm_loss": torch.tensor(2.5), "train/grad_norm": float("nan")})
    with MetricsWriter(tmp_path) as w:  # a resumed run continues the file
        w.write({"iteration": 2, "train/lm_loss": 2.0, "eval/lm_loss": 2.1})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {"iteration": 1, "train/lm_loss": 2.5, "train/grad_norm": None}
    rows = read_metrics(tmp_path)
    assert series(rows, "train/lm_loss") == [(1, 2.5), (2, 2.0)]
    assert series(rows, "eval/lm_loss") == [(2, 2.1)]


def test_disabled_writer_writes_nothing(tmp_path) -> None:
    w = MetricsWriter(tmp_path, enabled=False)
    w.write({"iteration": 1})
    w.close()
    assert not (tmp_path / METRICS_FILE).exists()


def test_peaks() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5  # not the SXM figure
    assert peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A10", "bf16") == 125.0  # "a10" must not shadow "a100" or the reverse
    assert peak_tflops("NVIDIA L40S", "bf16") == 362.1
    assert peak_tflops("NVIDIA L4", "bf16") == 121.0
    assert peak_tflops(None, "bf16") is None
    assert peak_tflops("some cpu", "fp32") is None


def test_measure_mfu() -> None:
    # 8 devices, 1000 tokens/iter, 10 iters in 2 s -> 5000 tok/s -> 625 per device
    t = measure(tokens_per_iter=1000, iterations=10, seconds=2.0, flops_per_token=1e9, world_size=8, peak=312.0)
    assert t.tokens_per_sec == pytest.approx(5000.0)
    assert t.tokens_per_sec_per_device == pytest.approx(625.0)
    assert t.tflops_per_device == pytest.approx(625.0 * 1e9 / 1e12)
    assert t.mfu == pytest.approx(t.tflops_per_device / 312.0)
    assert t.ms_per_iter == pytest.approx(200.0)
    assert "throughput/mfu" in as_metrics(t)
    assert "throughput/mfu" not in as_metrics(measure(tokens_per_iter=1, iterations=1, seconds=1.0,
                                                     flops_per_token=1.0, world_size=1, peak=None))


def test_format_row() -> None:
    line = format_row({"iteration": 3, "train/lm_loss": 1.5, "train/lr": 1e-3, "throughput/mfu": 0.4}, 10)
    assert line.startswith("iteration 3/10 | loss 1.500000 | lr 1.000e-03")
    assert "MFU 40.0%" in line
