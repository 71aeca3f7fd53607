#!/usr/bin/env python
"""Train the dense ``configs/tiny.yml`` and the MoE ``configs/tiny-moe.yml`` on the built-in corpus
for the same steps, and print both loss curves side by side.

The MoE model has the dense model's shape with each MLP replaced by 4 experts of the same width,
top-1 routed: the same parameters per token (plus a 4x64 router per layer), four times the MLP
weights. Both runs use the same data order, seed, batch, schedule and 2 CPU ranks (the MoE run
splits its experts over them with all-to-all). ``prepare_data.py`` must have built data/pydocs.

    python tools/bench/moe_vs_dense.py                 # 200 steps each (a few minutes on 2 cores)
    python tools/bench/moe_vs_dense.py --steps 400

Prints train loss every ``--every`` steps, the final eval loss, the per-token parameter counts and
the wall time of each run, and the MoE router statistics at the end.

Measured here (2 shared CPU cores, 2026-11-22): after 200 steps the MoE model is still behind
(train 6.301 vs 6.276, eval 6.366 vs 6.342): each expert has seen a quarter of the tokens and its
output is scaled by a router probability near 1/4 at the start. With ``--steps 1000`` it passes the
dense model around step 500 and ends lower (train 4.905 vs 4.917, eval 5.428 vs 5.444).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUNS = {"dense": "configs/tiny.yml", "moe": "configs/tiny-moe.yml"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(config: str, steps: int, out: Path) -> tuple[list[dict], float]:
    """Run deepy.py on ``config`` + local_setup for ``steps`` steps; (metrics rows, seconds)."""
    overrides = [f"train_iters={steps}", f"lr_decay_iters={steps}", f"log_dir={out / 'logs'}",
                 f"save={out / 'ckpt'}", f"load={out / 'ckpt'}", f"checkpoint_factor={steps}",
                 f"eval_interval={steps}", "log_interval=10", f"master_port={free_port()}"]  # fmt: skip
    cmd = [sys.executable, "deepy.py", "train.py", config, "configs/local_setup.yml", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{config} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return rows, seconds


def parameters(config: str) -> tuple[int, int]:
    """(total, active per token) parameters without embeddings, from the config alone."""
    from megatron.model import num_parameters
    from megatron.neox_arguments import load_config

    args = load_config([str(REPO / config)]).args
    cfg = args.with_vocab(128)  # the arguments are the model config; embeddings are left out of both counts
    return num_parameters(cfg, include_embeddings=False), num_parameters(cfg, include_embeddings=False, active=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="print the curves every this many steps")
    opts = parser.parse_args()
    if not (REPO / "data" / "pydocs").is_dir():
        sys.exit("data/pydocs is missing: run `python prepare_data.py` first")

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in RUNS.items():
            print(f"training {name} ({config}) for {opts.steps} steps ...", flush=True)
            results[name] = train(config, opts.steps, Path(tmp) / name)

    curves = {name: {r["iteration"]: r["train/lm_loss"] for r in rows if "train/lm_loss" in r}
              for name, (rows, _) in results.items()}  # fmt: skip
    evals = {name: [r["eval/lm_loss"] for r in rows if "eval/lm_loss" in r] for name, (rows, _) in results.items()}
    print(f"\n{'step':>6} {'dense':>9} {'moe':>9} {'moe-dense':>10}")
    for step in sorted(set(curves["dense"]) & set(curves["moe"])):
        if step % opts.every == 0 or step == opts.steps:
            d, m = curves["dense"][step], curves["moe"][step]
            print(f"{step:>6} {d:>9.4f} {m:>9.4f} {m - d:>+10.4f}")
    d, m = evals["dense"][-1], evals["moe"][-1]
    print(f"{'eval':>6} {d:>9.4f} {m:>9.4f} {m - d:>+10.4f}")
    for name, config in RUNS.items():
        total, active = parameters(config)
        print(f"{name:>6}: {total:,} parameters without embeddings, {active:,} per token; "
              f"{results[name][1]:.0f} s wall")  # fmt: skip
    last = [r for r in results["moe"][0] if "moe/router_entropy" in r][-1]
    shares = [round(last[k], 3) for k in sorted(last) if k.startswith("moe/expert_share/")]
    print(f"   moe router at step {last['iteration']}: expert shares {shares}, entropy "
          f"{last['moe/router_entropy']:.3f} nats, load-balancing loss {last['train/moe_aux_loss']:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
