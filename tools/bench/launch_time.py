#!/usr/bin/env python
"""Wall time from ``python deepy.py train.py configs/tiny.yml configs/local_setup.yml`` to its first
logged step, by phase, optionally side by side with another revision of the repository.

    python tools/bench/launch_time.py                      # this checkout, 3 launches
    python tools/bench/launch_time.py --baseline 45ebd4f   # and a git worktree of 45ebd4f, interleaved
    python tools/bench/launch_time.py --env DEEPY_FORK_RANKS=0   # and this checkout with that variable set

A baseline worktree's own ``megatron.launcher.local_ranks`` is not what its launch runs: ``python -m`` puts
the working directory (this checkout, where ``data/pydocs`` is) first on ``sys.path``. Compare launcher
changes with ``--env`` where a variable switches them.

Each launch runs the README's training command from the repository root (so ``data/pydocs`` from
``prepare_data.py`` must exist) with its checkpoints and logs in a fresh temporary folder and
``log_interval=1``, and stops after 2 steps. The phases are read off the console lines as they
arrive:

- ``config``: deepy.py started -> ``deepy: starting N rank(s)`` (load, merge, validate, split);
- ``ranks``: -> the last ``deepy: rank=...`` line (launcher and rank processes start, imports,
  process groups; printed with ``deepspeed_log_level=info``, which every launch here sets);
- ``model``: -> the run header's ``model  N parameters`` line (model, optimizer, DeepSpeed engine);
- ``first step``: -> the first ``iteration 1/`` line (data, the step itself);
- ``exit``: -> deepy.py returned (the remaining step, evaluation, checkpoint, teardown).

``cpu s`` is the CPU time of deepy.py and every process it started (they are all waited for), which
shared cores inflate less than wall time. Launches of the two revisions alternate, so load from
elsewhere on the machine falls on both alike; the median of each column is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = (
    ("config", re.compile(r"^deepy: starting \d+ rank")),
    ("ranks", re.compile(r"^deepy: rank=")),  # each rank's place: printed at deepspeed_log_level=info (below)
    ("model", re.compile(r"^(model: |  model\s+)[\d,]+ parameters")),  # the run header's model line (older: model:)
    ("first step", re.compile(r"^iteration 1/")),
)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(repo: Path, data_root: Path, ranks: int, zero: int | None = None,
           extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """One launch from ``repo``'s scripts with ``data_root`` as the working directory; seconds since
    start at which each phase ended, and the CPU seconds of the whole launch."""
    with tempfile.TemporaryDirectory(prefix="deepy-launch-") as tmp:
        argv = [sys.executable, str(repo / "deepy.py"), str(repo / "train.py"), "configs/tiny.yml",
                "configs/local_setup.yml", f"num_gpus={ranks}", "train_iters=2", "log_interval=1",
                "deepspeed_log_level=info",  # --verbose's console: each rank says where it sits (the "ranks" phase)
                f"save={tmp}/ckpt", f"load={tmp}/ckpt", f"log_dir={tmp}/logs"]  # fmt: skip
        if zero is not None:
            argv.append(f"zero_optimization={{stage: {zero}}}")
        env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        cpu0, start = children_cpu(), time.perf_counter()
        proc = subprocess.Popen(argv, cwd=data_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        seen: dict[str, float] = {}
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            now = time.perf_counter() - start
            for name, pattern in PHASES:
                if pattern.search(line) and (name == "ranks" or name not in seen):
                    seen[name] = now
        code = proc.wait()
        seen["exit"] = time.perf_counter() - start
        if code != 0 or len(seen) != len(PHASES) + 1:
            sys.exit(f"launch from {repo} failed (exit {code}):\n{''.join(lines[-40:])}")
        seen["cpu s"] = children_cpu() - cpu0
        return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="num_gpus (CPU ranks here), 2 as in configs/local_setup.yml")
    parser.add_argument("--zero", type=int, default=None,
                        help="ZeRO stage (configs/tiny.yml has none); stages 1-3 build DeepSpeed's ZeRO optimizer")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="also launch this checkout with these variables set (repeatable)")
    options = parser.parse_args()
    if not (REPO / "data" / "pydocs").is_dir():
        sys.exit("data/pydocs is missing: run `python prepare_data.py` first")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    contenders: dict[str, tuple[Path, dict[str, str]]] = {"this checkout": (REPO, {})}
    if options.env:
        variables = dict(item.split("=", 1) for item in options.env)
        contenders = {" ".join(options.env): (REPO, variables), **contenders}
    worktree = None
    if options.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="deepy-baseline-")) / "repo"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), options.baseline],
                       check=True, capture_output=True)  # fmt: skip
        contenders = {options.baseline: (worktree, {}), **contenders}
    try:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
        for _ in range(options.repeats):
            for name, (repo, variables) in contenders.items():
                results[name].append(launch(repo, REPO, options.ranks, options.zero, variables))
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)

    columns = [name for name, _ in PHASES] + ["exit", "cpu s"]
    zero = "" if options.zero is None else f", ZeRO-{options.zero}"
    print(f"{options.ranks} rank(s){zero}, median of {options.repeats} launches; seconds since `python deepy.py` started")
    width = max(14, *(len(name) for name in contenders))
    print(f"| {'revision':<{width}} | " + " | ".join(f"{c:>10}" for c in columns) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 12 for _ in columns) + "|")
    medians = {name: {c: statistics.median(r[c] for r in runs) for c in columns} for name, runs in results.items()}
    for name, row in medians.items():
        print(f"| {name:<{width}} | " + " | ".join(f"{row[c]:>10.2f}" for c in columns) + " |")
    for other in [name for name in medians if name != "this checkout"]:
        base, now = medians[other], medians["this checkout"]
        print(f"{other} -> this checkout: first step {base['first step']:.2f} s -> {now['first step']:.2f} s "
              f"({now['first step'] / base['first step']:.2f}x); CPU {base['cpu s']:.1f} -> {now['cpu s']:.1f} s")


if __name__ == "__main__":
    main()
