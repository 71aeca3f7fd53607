"""What the training benchmarks share: the architecture every contender builds, a one-rank process
group, interleaved timing rounds, the machine's measured matmul peak, and the printed report.

Timing on a shared machine: other processes only ever slow a block of steps down, and their load
drifts. So contenders run in rounds (A B C, then B C A, ...), each round one timed block per
contender, and the report gives each contender's median block and the median of the per-round
ratios: a ratio taken within one round compares blocks that ran under the same load.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from megatron.logging.throughput import DEVICE_PEAKS, peak_tflops
from megatron.model import GPTConfig, flops_per_token

REPO = Path(__file__).resolve().parents[2]
Precision = Literal["fp32", "bf16"]
Clock = Literal["wall", "cpu"]

# "cpu": CPU seconds of this process (all its threads). On a CPU machine shared with other jobs,
# wall time measures the neighbours as much as the code; with one thread (--threads 1) the CPU time a
# step takes hardly depends on them, so contenders stay comparable even under heavy load.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True, kw_only=True, slots=True)
class Arch:
    """One GPT-NeoX-style architecture and batch, built the same way by every contender:
    rotary on all head dims, pre-layernorm, GELU MLP of 4x width, biases, untied output, no dropout."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    """Sequences per optimizer step (one micro-batch, one rank)."""
    vocab: int
    precision: Precision

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                         seq_length=self.seq, padded_vocab_size=self.vocab, pos_emb="rotary", norm="layernorm",
                         no_weight_tying=True)

    def flops_per_token(self) -> float:
        """Model FLOPs (forward + backward, no recompute): the same count for every contender."""
        return flops_per_token(self.gpt_config(), self.seq)

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.hidden} hidden ({self.heads} heads), seq {self.seq}, "
                f"batch {self.batch}, vocab {self.vocab}, {self.precision}")


def add_arch_arguments(p: argparse.ArgumentParser, *, layers: int = 4, hidden: int = 256, heads: int = 8,
                       seq: int = 256, batch: int = 8, vocab: int = 8192) -> None:
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch, help="sequences per step (1 rank, no accumulation)")
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="default: bf16 on a GPU, fp32 on a CPU")


def arch_from(o: argparse.Namespace) -> Arch:
    precision: Precision = o.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    return Arch(layers=o.layers, hidden=o.hidden, heads=o.heads, seq=o.seq, batch=o.batch, vocab=o.vocab,
                precision=precision)


# --- the process ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:  # any free port: several benchmarks may run side by side
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def single_process_env() -> None:
    """The environment DeepSpeed's launcher would give rank 0 of a one-rank job."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(key, value)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({torch.get_num_threads()} threads of {os.cpu_count()} cores)"


def load_note() -> str:
    """The 1/5/15-minute load averages: how busy the machine was while it was measured."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def dense_peak(precision: Precision) -> float | None:
    """The device's dense peak TFLOP/s from the table in megatron/logging/throughput.py (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(), precision)


def matmul_tflops(precision: Precision, n: int | None = None, repeats: int = 3, clock: Clock = "wall") -> float:
    """The best achieved TFLOP/s of an n x n @ n x n matmul: the machine's practical compute ceiling
    (fp32 on a CPU, the run's precision on a GPU)."""
    dev = device()
    dtype = torch.bfloat16 if precision == "bf16" and dev.type == "cuda" else torch.float32
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    inner = 20 if dev.type == "cuda" else 1
    torch.mm(a, b)
    best = float("inf")
    now = CLOCKS[clock]
    for _ in range(repeats):
        synchronize()
        start = now()
        for _ in range(inner):
            torch.mm(a, b)
        synchronize()
        best = min(best, (now() - start) / inner)
    return 2.0 * n**3 / best / 1e12


# --- contenders and rounds --------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    """Short key used in ratios (`deepy`, `hf`, `nanogpt`, `raw`)."""
    label: str
    """What runs, for the report."""
    step: Callable[[], None]
    """One optimizer step over `Arch.tokens_per_step` tokens."""
    block_seconds: list[float] = field(default_factory=list)
    peak_memory_gb: float | None = None


def time_block(step: Callable[[], None], steps: int, clock: Clock = "wall") -> float:
    now = CLOCKS[clock]
    synchronize()
    start = now()
    for _ in range(steps):
        step()
    synchronize()
    return now() - start


def run_rounds(contenders: Sequence[Contender], *, warmup: int, block: int, rounds: int, clock: Clock = "wall",
               progress: Callable[[str], None] | None = None) -> None:
    """Warm every contender up, then `rounds` rounds of one timed `block` per contender; the order
    rotates each round so that none always runs first (or right after the same neighbour)."""
    for c in contenders:
        started = time.perf_counter()
        for _ in range(warmup):
            c.step()
        synchronize()
        if progress and warmup:  # the first steps compile and allocate: minutes with --compile
            progress(f"warm-up: {c.name} {warmup} step{'s' if warmup > 1 else ''} in {time.perf_counter() - started:.1f} s")
    for r in range(rounds):
        order = list(contenders[r % len(contenders):]) + list(contenders[: r % len(contenders)])
        for c in order:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            c.block_seconds.append(time_block(c.step, block, clock))
            if torch.cuda.is_available():
                gb = torch.cuda.max_memory_allocated() / 2**30
                c.peak_memory_gb = max(c.peak_memory_gb or 0.0, gb)
        if progress:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{c.name} {block / c.block_seconds[-1]:.2f} steps/s" for c in contenders))


# --- the report ----------------------------------------------------------------------------------
def per_round_ratio(a: Contender, b: Contender) -> float:
    """Median over rounds of tokens/s(a) / tokens/s(b), each ratio within one round."""
    return statistics.median(tb / ta for ta, tb in zip(a.block_seconds, b.block_seconds))


def report(arch: Arch, contenders: Sequence[Contender], *, block: int, matmul_peak: float, clock: Clock = "wall",
           goals: dict[tuple[str, str], float] | None = None) -> str:
    """The side-by-side table: tokens/s (median and best block), TFLOP/s, share of the measured
    matmul peak, MFU against the device's dense peak (GPU), peak memory (GPU), then ratios."""
    tokens = arch.tokens_per_step * block
    flops = arch.flops_per_token()
    peak = dense_peak(arch.precision)
    lines = [
        f"model: {arch.describe()}; {flops / 1e9:.3f} GFLOP/token (6N + 12 L h s)",
        f"device: {device_name()}; {load_note()}",
        f"measured {'bf16' if arch.precision == 'bf16' and torch.cuda.is_available() else 'fp32'} matmul peak: "
        f"{matmul_peak:.3f} TFLOP/s" + (f"; dense {arch.precision} peak of the device: {peak:.1f} TFLOP/s" if peak else ""),
        f"{len(contenders[0].block_seconds)} rounds of {block} steps per contender, interleaved; "
        + ("wall-clock time" if clock == "wall" else "CPU time of the process (tokens per CPU-second)"),
        "",
        f"{'contender':<10} {'tokens/s median':>16} {'best':>12} {'TFLOP/s':>9} {'of matmul':>10}"
        + (f" {'MFU':>7}" if peak else "") + (f" {'peak mem':>9}" if torch.cuda.is_available() else "")
        + "  what",
    ]
    for c in contenders:
        median = tokens / statistics.median(c.block_seconds)
        best = tokens / min(c.block_seconds)
        tflops = median * flops / 1e12
        row = f"{c.name:<10} {median:>16,.0f} {best:>12,.0f} {tflops:>9.3f} {tflops / matmul_peak:>9.1%}"
        if peak:
            row += f" {tflops / peak:>7.1%}"
        if torch.cuda.is_available():
            row += f" {c.peak_memory_gb or 0.0:>7.2f}GB"
        lines.append(row + f"  {c.label}")
    by_name = {c.name: c for c in contenders}
    lines.append("")
    for (a, b), goal in (goals or {}).items():
        if a in by_name and b in by_name:
            ratio = per_round_ratio(by_name[a], by_name[b])
            verdict = "meets" if ratio >= goal else "below"
            lines.append(f"ratio {a}/{b}: {ratio:.3f} (median of per-round ratios; goal >= {goal:g}: {verdict})")
    return "\n".join(lines)


__all__ = ["DEVICE_PEAKS", "Arch", "Contender", "add_arch_arguments", "arch_from", "dense_peak", "device",
           "device_name", "load_note", "matmul_tflops", "report", "run_rounds", "single_process_env",
           "synchronize"]
