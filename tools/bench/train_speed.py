#!/usr/bin/env python
"""Training speed of shipped configs through the real path: ``deepy.py train.py CONFIG key=value...``
on one device, dummy data, a fixed number of steps after warm-up.

    python tools/bench/train_speed.py                          # GPU: 125M 350M pythia/410M 1-3B; CPU: tiny
    python tools/bench/train_speed.py 1-3B --micro-batch 4,8   # sweep the micro batch
    python tools/bench/train_speed.py 125M --dry-run           # print the commands only

On a GPU every config runs in bf16 with ZeRO-1 (the shipped configs' stage) on a plain engine
(``pipe_parallel_size=0``: one device needs no pipeline), activation checkpointing off unless
``--checkpoint-activations``, ``compile_layers`` on unless ``--no-compile``. On a CPU the config keeps
its own precision and the run is a smoke test of the same path. The tokenizer is generated: on a GPU
a GPT-2-sized vocabulary (50,257 tokens, padded to 50,304 like GPT-NeoX), so the output layer has
its real size without any file from outside the repository; 2,048 tokens on a CPU.

Prints per config: the exact command and overrides, tokens/s, TFLOP/s per device, MFU against the
device's dense peak (``megatron/logging/throughput.py``), peak memory, from the run's own
``metrics.jsonl`` (the first ``--warmup`` steps, which include compilation, are left out).
``--json FILE`` also writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

GPU_CONFIGS = ("125M", "350M", "pythia/410M", "1-3B")
CPU_CONFIGS = ("tiny",)
# the goals on one H100 in bf16 (MFU)
MFU_GOALS = {"125M": 0.35, "1-3B": 0.45}
# micro batch per GPU without activation checkpointing on an 80 GB card, estimated (activations
# ~34 bytes x seq x hidden per layer and sample in bf16, weights + fp32 Adam state ~18 bytes per
# parameter); --micro-batch overrides, e.g. to sweep
GPU_MICRO_BATCH = {"125M": 16, "350M": 8, "pythia/410M": 8, "1-3B": 8}


@dataclass
class Result:
    config: str
    micro_batch: int
    command: list[str]
    overrides: list[str]
    ok: bool
    tokens_per_sec: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    max_allocated_gb: float | None = None
    max_reserved_gb: float | None = None
    measured_steps: int = 0
    error: str | None = None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("configs", nargs="*", help="config names under configs/ (default: GPU "
                   f"{' '.join(GPU_CONFIGS)}; CPU {' '.join(CPU_CONFIGS)})")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="which defaults to use (auto: gpu when torch sees CUDA)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 20 GPU, 4 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out first (default 10 GPU, 2 CPU)")
    p.add_argument("--micro-batch", default=None,
                   help="micro batch per device, or a comma-separated sweep, or 'config' for the config's own "
                        f"(default: on a GPU {GPU_MICRO_BATCH}, else the config's)")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32", "config"], default=None,
                   help="default: bf16 on a GPU, the config's own on a CPU")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="compile_layers (default on a GPU)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--checkpoint-activations", action="store_true", help="keep activation checkpointing on")
    p.add_argument("--keep-pipeline", action="store_true",
                   help="keep the config's pipe_parallel_size (default: 0, the plain engine)")
    p.add_argument("--vocab", type=int, default=None,
                   help="size of the generated tokenizer's vocabulary (default: GPT-2's 50257 on a GPU, 2048 on a CPU)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override, after the bench's own (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    return p.parse_args(argv)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json with `vocab_size` ids (the last one `<|endoftext|>`): the dummy
    data never decodes text, only the vocabulary size (and so the output layer's shape) matters."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<|endoftext|>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def overrides_for(o: argparse.Namespace, gpu: bool, micro_batch: int | None, work: Path) -> list[str]:
    steps, warmup = o.steps, o.warmup
    out = [
        "num_gpus=1", "model_parallel_size=1", "use_dummy_dataset=true",
        "tokenizer_type=HFTokenizer", f"vocab_file={work / 'tokenizer.json'}",
        f"train_iters={warmup + steps}", f"lr_decay_iters={warmup + steps}", f"log_interval={warmup}",
        "eval_iters=0", "steps_per_print=1000000", "wall_clock_breakdown=false",
        f"log_dir={work / 'logs'}", f"zero_optimization.stage={o.zero}",
        # no checkpoints: shipped configs schedule saves, but a benchmark writes none
        "checkpoint_factor=null", "extra_save_iters=null",
    ]
    if not o.keep_pipeline:
        out.append("pipe_parallel_size=0")
    if micro_batch is not None:
        out += [f"train_micro_batch_size_per_gpu={micro_batch}", f"train_batch_size={micro_batch}",
                "gradient_accumulation_steps=1"]
    precision = o.precision or ("bf16" if gpu else "config")
    if precision != "config":
        out += {"bf16": ["precision=bfloat16"], "fp16": ["precision=fp16"], "fp32": ["precision=fp32"]}[precision]
    if not o.checkpoint_activations:
        out += ["checkpoint_activations=false", "partition_activations=false", "synchronize_each_layer=false"]
    if o.compile if o.compile is not None else gpu:
        out.append("compile_layers=true")
    return out + list(o.extra)


def read_rows(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(result: Result, rows: list[dict[str, Any]], warmup: int) -> None:
    """Throughput over the logged windows after the warm-up (total tokens / total time)."""
    rows = [r for r in rows if "throughput/tokens_per_sec" in r]
    windows = [(r, r["iteration"] - prev["iteration"]) for prev, r in zip([{"iteration": 0}] + rows, rows)]
    timed = [(r, steps) for r, steps in windows if r["iteration"] > warmup]
    if not timed:
        result.ok, result.error = False, "no logged step after the warm-up"
        return
    seconds = sum(r["timers/ms_per_iter"] * steps for r, steps in timed) / 1000.0
    tokens = sum(r["throughput/tokens_per_sec"] * r["timers/ms_per_iter"] * steps for r, steps in timed) / 1000.0
    last = timed[-1][0]
    result.tokens_per_sec = tokens / seconds
    # TFLOP/s and MFU are proportional to tokens/s within one run
    scale = result.tokens_per_sec / last["throughput/tokens_per_sec"]
    result.tflops_per_device = last["throughput/tflops_per_device"] * scale
    result.mfu = last["throughput/mfu"] * scale if "throughput/mfu" in last else None
    result.max_allocated_gb = last.get("memory/max_allocated_gb")
    result.max_reserved_gb = last.get("memory/max_reserved_gb")
    result.measured_steps = sum(steps for _, steps in timed)


def run_one(o: argparse.Namespace, config: str, micro_batch: int | None, gpu: bool, root: Path) -> Result:
    work = root / f"{config.replace('/', '_')}_mb{micro_batch or 'cfg'}"
    work.mkdir(parents=True, exist_ok=True)
    overrides = overrides_for(o, gpu, micro_batch, work)
    name = config if config.endswith((".yml", ".yaml")) else f"{config}.yml"
    command = [sys.executable, "deepy.py", "train.py", str(Path("configs") / name), *overrides]
    result = Result(config=config, micro_batch=micro_batch or 0, command=command, overrides=overrides, ok=True)
    print(f"\n=== {config}" + (f", micro batch {micro_batch}" if micro_batch else ""), flush=True)
    print("command: " + " ".join(command), flush=True)
    if o.dry_run:
        return result
    write_tokenizer(work / "tokenizer.json", o.vocab)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=o.timeout)
    except subprocess.TimeoutExpired:
        result.ok, result.error = False, f"timed out after {o.timeout} s"
        print(result.error, flush=True)
        return result
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        oom = "out of memory" in tail.lower()
        result.ok, result.error = False, ("out of memory: " if oom else "") + f"exit code {proc.returncode}"
        print(f"FAILED ({result.error}):\n{tail}", flush=True)
        return result
    summarize(result, read_rows(work / "logs"), o.warmup)
    print(f"wall {time.perf_counter() - start:.0f} s; " + describe(result), flush=True)
    return result


def describe(r: Result) -> str:
    if not r.ok:
        return f"failed: {r.error}"
    parts = [f"{r.tokens_per_sec:,.0f} tokens/s", f"{r.tflops_per_device:.2f} TFLOP/s per device"]
    parts.append(f"MFU {r.mfu:.1%}" if r.mfu is not None else "MFU n/a (no dense peak known for this device)")
    if r.max_allocated_gb is not None:
        parts.append(f"peak memory {r.max_allocated_gb:.1f} GiB allocated / {r.max_reserved_gb:.1f} GiB reserved")
    return ", ".join(parts) + f" over {r.measured_steps} steps"


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__}); load average {os.getloadavg()}"


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    import torch

    gpu = o.device == "gpu" or (o.device == "auto" and torch.cuda.is_available())
    o.steps = o.steps or (20 if gpu else 4)
    o.warmup = o.warmup or (10 if gpu else 2)
    o.vocab = o.vocab or (50257 if gpu else 2048)
    configs = o.configs or list(GPU_CONFIGS if gpu else CPU_CONFIGS)
    def sweep(config: str) -> list[int | None]:
        if o.micro_batch == "config" or (o.micro_batch is None and not gpu):
            return [None]
        if o.micro_batch is None:
            return [GPU_MICRO_BATCH.get(config)]
        return [int(x) for x in o.micro_batch.split(",")]

    print(f"device: {device_line()}; {o.warmup} warm-up + {o.steps} measured steps per run", flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="deepy-speed-") as tmp:
        for config in configs:
            for mb in sweep(config):
                results.append(run_one(o, config, mb, gpu, Path(tmp)))
    if o.dry_run:
        return 0
    print("\nsummary")
    for r in results:
        goal = MFU_GOALS.get(r.config) if gpu else None
        verdict = ""
        if goal is not None and r.mfu is not None:
            verdict = f"  (goal MFU >= {goal:.0%}: {'meets' if r.mfu >= goal else 'below'})"
        batch = f" mb {r.micro_batch}" if r.micro_batch else ""
        print(f"  {r.config}{batch}: {describe(r)}{verdict}")
    if o.json:
        o.json.write_text(json.dumps({"device": device_line(), "results": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
