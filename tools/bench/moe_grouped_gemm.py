#!/usr/bin/env python
"""The expert matmul three ways, forward + backward: one grouped GEMM (``torch.nn.functional.grouped_mm``
through ``megatron.model.moe.grouped_matmul``), a Python loop over experts, and the padded batched
matmul (every expert's rows padded to the largest count, one ``bmm``: ``padded_grouped_matmul``, the
accelerator fallback).

    python tools/bench/moe_grouped_gemm.py             # CPU, 1 thread, best of --repeats
    python tools/bench/moe_grouped_gemm.py --threads 2

Token counts per expert are drawn from a multinomial (a realistic, uneven routing). Prints ms per
forward+backward and each method's time relative to the grouped GEMM.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from megatron.model.moe import _grouped_mm_fits, grouped_matmul, padded_grouped_matmul

REPO = Path(__file__).resolve().parents[2]
SHAPES = [  # (assignments, hidden, expert width, local experts)
    (512, 64, 256, 4),
    (2048, 256, 1024, 8),
    (4096, 512, 2048, 8),
]


def grouped(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    assert _grouped_mm_fits(x, w)  # the production path, not its fallback
    return grouped_matmul(x, w, torch.tensor(counts))


def loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for e, count in enumerate(counts):
        outs.append(x[start : start + count] @ w[e])
        start += count
    return torch.cat(outs)


def padded(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return padded_grouped_matmul(x, w, torch.tensor(counts))


def best_ms(fn, x: torch.Tensor, w: torch.Tensor, counts: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        x.grad = w.grad = None
        start = time.perf_counter()
        y = fn(x, w, counts)
        y.backward(torch.ones_like(y))
        times.append(time.perf_counter() - start)
    return 1000 * min(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    methods = {"grouped_mm": grouped, "loop": loop, "padded_bmm": padded}
    print(f"torch {torch.__version__}, {opts.threads} thread(s); ms per forward+backward (best of {opts.repeats})")
    print(f"{'tokens x hidden x width x experts':>34} " + " ".join(f"{m:>18}" for m in methods))
    for tokens, hidden, width, experts in SHAPES:
        x = torch.randn(tokens, hidden, requires_grad=True)
        w = (torch.randn(experts, hidden, width) / hidden**0.5).requires_grad_()
        counts = torch.distributions.Multinomial(tokens, torch.ones(experts)).sample().long().tolist()
        want = loop(x, w, counts)
        for fn in methods.values():
            torch.testing.assert_close(fn(x, w, counts), want, rtol=1e-4, atol=1e-4)
        ms = {name: best_ms(fn, x, w, counts, opts.repeats) for name, fn in methods.items()}
        cells = [f"{ms[m]:9.2f} ({ms[m] / ms['grouped_mm']:4.2f}x)" for m in methods]
        print(f"{f'{tokens} x {hidden} x {width} x {experts}':>34} " + " ".join(f"{c:>18}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
