"""How long the training loop stops for a checkpoint: synchronous saves against background ones (``async_save``),
side by side in one run, to local disk and (``--s3``) into a bucket.

One process (gloo, world 1) trains a DeepSpeed engine (an MLP of ``--params`` parameters, Adam: ~12 bytes per
parameter on disk) through the checkpoint manager the trainer uses, saving every ``--every`` steps. The loop's stop
for a save is the time from the manager's ``maybe_save`` call to its return, plus any wait for the previous
background save (the next save, and the end of the run, wait for it); steps between saves go on meanwhile. The
``--s3`` rows save into a bucket of a moto server this script starts on localhost (the upload is part of a
synchronous save; a background save uploads on its own thread).

    python tools/bench/save_stall.py                      # 20M parameters, 4 saves each, local disk
    python tools/bench/save_stall.py --s3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_case(mode: str, target: str, root: Path, params: int, saves: int, every: int, step_s: float) -> dict[str, Any]:
    import deepspeed
    import torch

    from megatron.checkpointing.config import CheckpointArgs
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher
    from megatron.mpu import topology

    width = params // 33  # Linear(16, w) + Linear(w, 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16))
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=topology)
    save = f"s3://deepy-bench/{mode}" if target == "s3" else str(root / mode)
    keys = CheckpointArgs(save=save, checkpoint_factor=every, async_save=mode == "async",
                          checkpoint_staging_dir=str(root / "staging" / mode), s3_chunk_size=8 * 1024 * 1024)
    manager = CheckpointManager.from_config(keys, args_record={}, train_iters=saves * every,
                                            preemption=PreemptionWatcher())
    stalls: list[float] = []
    started = time.perf_counter()
    for step in range(1, saves * every + 1):
        out = engine(torch.randn(4, 16))
        engine.backward(out.square().mean())
        engine.step()
        time.sleep(step_s)  # the rest of a step's work (a GPU's forward and backward) while a write goes on
        begun = time.perf_counter()
        saved = manager.maybe_save(engine, step, step * 4).saved
        if saved:
            stalls.append(time.perf_counter() - begun)
    begun = time.perf_counter()
    manager.wait("the end of the run")
    final_wait = time.perf_counter() - begun
    total = time.perf_counter() - started
    size = sum(p.stat().st_size for p in Path(manager.save_dir or ".").rglob("*.pt"))
    return {"mode": mode, "target": target, "params": sum(p.numel() for p in model.parameters()),
            "checkpoint_mb": size / saves / 1e6, "stall_s": stalls, "mean_stall_s": sum(stalls) / len(stalls),
            "final_wait_s": final_wait, "total_s": total}


def start_moto(root: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (root / "moto.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2).read()
            break
        except OSError:
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="deepy-bench")
    return process, env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=20_000_000)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="other work per step (sleep)")
    parser.add_argument("--s3", action="store_true", help="also save into a bucket (moto server on localhost)")
    parser.add_argument("--json")
    opts = parser.parse_args()

    import torch.distributed as dist

    from megatron.deepspeed_internals import skip_shared_memory_comm_op
    from megatron.mpu import topology

    skip_shared_memory_comm_op()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    root = Path(tempfile.mkdtemp(prefix="deepy-save-stall-"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    topology.initialize_model_parallel(1, 1)
    moto = start_moto(root)[0] if opts.s3 else None
    rows = []
    try:
        for target in ("local", "s3") if opts.s3 else ("local",):
            for mode in ("sync", "async"):
                rows.append(run_case(mode, target, root, opts.params, opts.saves, opts.every, opts.step_seconds))
    finally:
        if moto is not None:
            moto.terminate()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'target':<7}{'mode':<7}{'params':>12}{'ckpt MB':>10}{'loop stop per save s':>23}{'end wait s':>12}"
          f"{'run s':>8}{'stop vs sync':>14}")
    for row in rows:
        sync = next(r for r in rows if r["target"] == row["target"] and r["mode"] == "sync")
        ratio = row["mean_stall_s"] / sync["mean_stall_s"]
        print(f"{row['target']:<7}{row['mode']:<7}{row['params']:>12,}{row['checkpoint_mb']:>10.0f}"
              f"{row['mean_stall_s']:>23.3f}{row['final_wait_s']:>12.3f}{row['total_s']:>8.1f}{ratio:>13.2f}x")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
