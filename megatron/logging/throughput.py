"""Tokens per second, achieved TFLOP/s and MFU.

MFU counts model FLOPs only (the model family's ``flops_per_token``: 6·N plus attention, forward and
backward, no recomputation), divided by the accelerator's dense peak for the run's precision. The
peak is known only for listed accelerators; elsewhere (CPU) MFU is left out rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense (non-sparse) peak TFLOP/s per device, by precision, from NVIDIA's datasheets (the sparsity
# figures are twice these). Keys are matched as substrings of the name torch reports, longest first,
# so "h100 pcie" wins over "h100" and "a100" over "a10".
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "h100 nvl": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "a10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "a10g": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6},
    "l40": {"bf16": 181.05, "fp16": 181.05, "fp32": 90.5},
    "l4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "v100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Peak for a device name as torch reports it (``"NVIDIA H100 80GB HBM3"``), or None."""
    if not device_name:
        return None
    lowered = device_name.lower()
    # longest key first so "a100" never shadows a longer name that contains it
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in lowered:
            return PEAK_TFLOPS[key].get(precision)
    return None


def current_device_name() -> str | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return None


@dataclass(frozen=True)
class Throughput:
    tokens_per_sec: float
    tokens_per_sec_per_device: float
    tflops_per_device: float
    mfu: float | None
    ms_per_iter: float


def measure(
    *,
    tokens_per_iter: int,
    iterations: int,
    seconds: float,
    flops_per_token: float,
    world_size: int,
    peak: float | None,
) -> Throughput:
    """Throughput over ``iterations`` steps that took ``seconds`` on ``world_size`` devices."""
    seconds = max(seconds, 1e-9)
    iterations = max(iterations, 1)
    tokens_per_sec = tokens_per_iter * iterations / seconds
    per_device = tokens_per_sec / max(world_size, 1)
    tflops = per_device * flops_per_token / 1e12
    return Throughput(
        tokens_per_sec=tokens_per_sec,
        tokens_per_sec_per_device=per_device,
        tflops_per_device=tflops,
        mfu=tflops / peak if peak else None,
        ms_per_iter=1000.0 * seconds / iterations,
    )


def as_metrics(t: Throughput) -> dict[str, float]:
    row = {
        "throughput/tokens_per_sec": t.tokens_per_sec,
        "throughput/tokens_per_sec_per_device": t.tokens_per_sec_per_device,
        "throughput/tflops_per_device": t.tflops_per_device,
        "timers/ms_per_iter": t.ms_per_iter,
    }
    if t.mfu is not None:
        row["throughput/mfu"] = t.mfu
    return row
