"""Long-context figures side by side: tokens/s and memory per rank for cp1 and cp2, plain and
document-masked attention, at several sequence lengths.

Each case spawns its ranks (gloo, one process per rank, ``context_parallel_size`` of them) and
times forward + backward of Deepy's ``GPTModel`` on one sequence per step, after a warm-up step:

- ``tokens/s``: sequence tokens per second of one step (all ranks together; one CPU thread per rank);
- ``act MiB/rank``: bytes autograd saved for the backward pass on the busiest rank (the activation
  memory; counted through ``torch.autograd.graph.saved_tensors_hooks``, storages counted once);
- ``peak RSS MiB/rank``: the process's peak resident memory (``ru_maxrss``; includes Python, torch
  and the weights, so it halves less than the activations do). On a GPU the allocator's peak is shown.

The document-masked rows pack documents of ``--doc-length`` tokens (``reset_attention_mask``), so
attention runs per document (``megatron/model/documents.py``).

    python tools/bench/long_context.py                       # seq 2k/8k/16k, cp1/cp2, plain/docs
    python tools/bench/long_context.py --seq 2048 --steps 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]

EOD = 0


def _rank(rank: int, world: int, out_dir: str, seq: int, docs: bool, steps: int, doc_length: int,
          model: dict[str, Any]) -> None:
    # one thread per rank: cp1 runs on one core, cp2 on two (more threads per rank made the single-rank
    # timings swing 5x on a loaded 2-core machine)
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=30))
    from megatron import mpu
    from megatron.model import GPTConfig, GPTModel
    from megatron.objectives import ObjectiveArgs, build_objective, lm_loss_sum

    mpu.initialize_model_parallel(1, 1, world)
    config = GPTConfig(**model, seq_length=seq, padded_vocab_size=256, pos_emb="rotary", seed=1)
    net = GPTModel(config)
    text = torch.randint(1, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    if docs:
        text[0, doc_length - 1 :: doc_length] = EOD
    objective = build_objective(ObjectiveArgs(reset_attention_mask=docs, reset_position_ids=docs), eod_token=EOD)
    piece = objective.prepare({"text": text}).context_piece(rank, world)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    times = []
    for step in range(steps + 1):
        saved.clear()
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = lm_loss_sum(net(piece.inputs, **piece.model_kwargs()), piece.labels)
        activations = sum(saved.values())
        loss.backward()
        dist.barrier()
        if step > 0:  # the first step warms up allocations and kernels
            times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if torch.cuda.is_available():
        peak_rss = torch.cuda.max_memory_allocated() / 2**20
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": sorted(times)[len(times) // 2], "activation_mib": activations / 2**20, "peak_mib": peak_rss}))
    dist.barrier()
    dist.destroy_process_group()


def run_case(seq: int, cp: int, docs: bool, steps: int, doc_length: int, model: dict[str, Any]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(cp, out, seq, docs, steps, doc_length, model), nprocs=cp,
                           start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    seconds = max(r["seconds"] for r in ranks)
    return {"tokens_per_s": seq / seconds, "activation_mib": max(r["activation_mib"] for r in ranks),
            "peak_mib": max(r["peak_mib"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", default="2048,8192,16384", help="comma-separated sequence lengths")
    parser.add_argument("--cp", default="1,2", help="comma-separated context-parallel sizes")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--doc-length", type=int, default=512, help="tokens per document in the masked rows")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    model = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads}
    seqs = [int(s) for s in args.seq.split(",")]
    cps = [int(c) for c in args.cp.split(",")]
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads; batch 1; fp32; "
          f"{os.cpu_count()} CPU cores; documents of {args.doc_length} tokens in the masked rows", flush=True)
    header = f"{'seq':>6} {'attention':>9} {'cp':>3} {'tokens/s':>10} {'act MiB/rank':>13} {'peak RSS MiB/rank':>18} {'act vs cp1':>10}"
    print(header)
    rows = []
    for seq in seqs:
        for docs in (False, True):
            base = None
            for cp in cps:
                r = run_case(seq, cp, docs, args.steps, args.doc_length, model)
                base = base or r
                ratio = r["activation_mib"] / base["activation_mib"]
                print(f"{seq:>6} {'documents' if docs else 'plain':>9} {cp:>3} {r['tokens_per_s']:>10.0f} "
                      f"{r['activation_mib']:>13.1f} {r['peak_mib']:>18.0f} {ratio:>10.2f}", flush=True)
                rows.append({"seq": seq, "documents": docs, "cp": cp, **r})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
