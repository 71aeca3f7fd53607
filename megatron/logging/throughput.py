"""Tokens and samples per second, achieved TFLOP/s, MFU and HFU, per device.

MFU counts model FLOPs only (the model family's ``flops_per_token``: 6·N plus attention, forward and
backward, no recomputation), divided by the accelerator's dense peak for the run's precision. HFU
(hardware FLOPs utilisation) adds the forward passes that activation checkpointing recomputes, so
it is the higher of the two whenever blocks are recomputed. The peak comes from
``peak_theoretical_tflops`` when set, else from :data:`DEVICE_PEAKS` by the device name torch
reports; elsewhere (CPU, unknown devices) MFU is left out rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense (non-sparse) tensor-core peak TFLOP/s of one device, by the precision the run trains in,
# from the vendors' datasheets ("with sparsity" figures are twice these). fp32 is the plain FP32
# peak: torch leaves TF32 matmuls off by default. Keys are matched against the lower-cased device
# name, most specific first (see :func:`peak_tflops`).
DEVICE_PEAKS: dict[str, dict[str, float]] = {
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},
    "h200 nvl": {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0},
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp32": 67.0},
    "h100 nvl": {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM (HBM3); torch names it "H100 80GB HBM3"
    "h800 pcie": {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2},
    "h800": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "h20": {"bf16": 148.0, "fp16": 148.0, "fp32": 44.0},
    "a100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "a800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "a40": {"bf16": 149.7, "fp16": 149.7, "fp32": 37.4},
    "a30": {"bf16": 165.0, "fp16": 165.0, "fp32": 10.3},
    "a10g": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},  # AWS's A10G (NVIDIA publishes no sheet)
    "a10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "l40s": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "l40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5},
    "l4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "v100": {"fp16": 125.0, "fp32": 15.7},  # no bf16 tensor cores
    "t4": {"fp16": 65.0, "fp32": 8.1},
    "mi300x": {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4},
    "mi250x": {"bf16": 383.0, "fp16": 383.0, "fp32": 47.9},
}


def peak_tflops(device_name: str | None, precision: str, override: float | None = None) -> float | None:
    """Peak dense TFLOP/s: ``override`` (``peak_theoretical_tflops``) when given, else the table's
    entry for a device name as torch reports it (``"NVIDIA H100 80GB HBM3"``), else None."""
    if override is not None:
        return float(override)
    if not device_name:
        return None
    lowered = device_name.lower().replace("-", " ")
    # longest key first so "h100" never shadows "h100 pcie" and "a10" never shadows "a100"
    for key in sorted(DEVICE_PEAKS, key=len, reverse=True):
        if _has_word(lowered, key):
            return DEVICE_PEAKS[key].get(precision)
    return None


def _has_word(name: str, key: str) -> bool:
    """``key`` occurs in ``name`` as a whole word ("a10" is not in "a100", "h200" not in "gh200")."""
    start = name.find(key)
    while start >= 0:
        end = start + len(key)
        if (start == 0 or not name[start - 1].isalnum()) and (end == len(name) or not name[end].isalnum()):
            return True
        start = name.find(key, start + 1)
    return False


def current_device_name() -> str | None:
    # lazy: torch, only to name the device; tools read the arithmetic without it
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return None


@dataclass(frozen=True)
class Throughput:
    tokens_per_sec: float
    tokens_per_sec_per_device: float
    samples_per_sec: float
    tflops_per_device: float
    mfu: float | None
    hfu: float | None
    hardware_tflops_per_device: float
    ms_per_iter: float


def measure(
    *,
    tokens_per_iter: int,
    iterations: int,
    seconds: float,
    flops_per_token: float,
    world_size: int,
    peak: float | None,
    samples_per_iter: int | None = None,
    hardware_flops_per_token: float | None = None,
) -> Throughput:
    """Throughput over ``iterations`` steps that took ``seconds`` on ``world_size`` devices.

    ``hardware_flops_per_token`` counts recomputed forwards too (defaults to the model FLOPs).
    """
    seconds = max(seconds, 1e-9)
    iterations = max(iterations, 1)
    tokens_per_sec = tokens_per_iter * iterations / seconds
    per_device = tokens_per_sec / max(world_size, 1)
    tflops = per_device * flops_per_token / 1e12
    hw_tflops = per_device * (hardware_flops_per_token or flops_per_token) / 1e12
    return Throughput(
        tokens_per_sec=tokens_per_sec,
        tokens_per_sec_per_device=per_device,
        samples_per_sec=(samples_per_iter or 0) * iterations / seconds,
        tflops_per_device=tflops,
        mfu=tflops / peak if peak else None,
        hfu=hw_tflops / peak if peak else None,
        hardware_tflops_per_device=hw_tflops,
        ms_per_iter=1000.0 * seconds / iterations,
    )


def as_metrics(t: Throughput) -> dict[str, float]:
    row = {
        "throughput/tokens_per_sec": t.tokens_per_sec,
        "throughput/tokens_per_sec_per_device": t.tokens_per_sec_per_device,
        "throughput/samples_per_sec": t.samples_per_sec,
        "throughput/tflops_per_device": t.tflops_per_device,
        "timers/ms_per_iter": t.ms_per_iter,
    }
    if t.hardware_tflops_per_device != t.tflops_per_device:
        row["throughput/hardware_tflops_per_device"] = t.hardware_tflops_per_device
    if t.mfu is not None:
        row["throughput/mfu"] = t.mfu
    if t.hfu is not None and t.hfu != t.mfu:
        row["throughput/hfu"] = t.hfu
    return row
