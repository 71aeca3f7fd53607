"""``deepy-gpu-check``: what a node gives Deepy, in one command of under ten minutes.

    deepy-gpu-check                      # every check (a GPU node), results in ./gpu_check/
    deepy-gpu-check --dry-run            # the plan: each check, its cap, the total
    deepy-gpu-check --smoke              # the parts that run on a CPU, small (the test suite runs this)
    deepy-gpu-check --only attention,sync_audit --out results/

Each check runs in a process of its own, killed at its cap (``tools/gpu_check/plan.py``), so a hung or
crashing part costs its cap and the rest still run. Writes ``results.json`` (device, date, commit,
every check's figures) and ``table.md`` (the table docs/benchmarks.md keeps), and prints the table.
Exit code 0 when every check ran, 1 when one failed or ran out of time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.gpu_check.plan import PLAN, TEN_MINUTES, Check, describe, select, total_cap

REPO = Path(__file__).resolve().parents[2]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deepy-gpu-check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dry-run", action="store_true", help="print the plan and the caps, run nothing")
    p.add_argument("--smoke", action="store_true", help="only the parts that run on a CPU, with small shapes")
    p.add_argument("--only", default="", help=f"comma-separated checks, from {','.join(c.name for c in PLAN)}")
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="where results.json and table.md go")
    return p.parse_args(argv)


def run_check(check: Check, out: Path, smoke: bool) -> dict[str, Any]:
    """One check in its own process, killed at its cap."""
    target = out / f"{check.name}.json"
    target.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tools.gpu_check.checks", check.name, "--out", str(target)]
    start = time.perf_counter()
    try:
        done = subprocess.run([*cmd, *(["--smoke"] if smoke else [])], cwd=REPO, capture_output=True, text=True,
                              timeout=check.cap_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        tail = (done.stdout + done.stderr)[-1500:]
        code: int | None = done.returncode
    except subprocess.TimeoutExpired as err:
        tail, code = ((err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace"))[-1500:], None
    seconds = round(time.perf_counter() - start, 1)
    if target.is_file():
        result = json.loads(target.read_text())
    elif code is None:
        result = {"status": "timeout", "error": f"killed at its cap of {check.cap_s:.0f} s", "tail": tail}
    else:
        result = {"status": "error", "error": f"exited {code} without a result", "tail": tail}
    return {"seconds": seconds, "cap_s": check.cap_s, **result}


def summary(name: str, r: dict[str, Any]) -> str:
    """The table's one-line figure of a check."""
    if r.get("status") != "ok":
        return str(r.get("error", r.get("status")))[:160]
    if name == "environment":
        return (f"{r.get('device')}; torch {r.get('torch')} CUDA {r.get('cuda')} NCCL {r.get('nccl')} "
                f"Triton {r.get('triton')}; toolchain: {'; '.join(r['compile_toolchain_problems']) or 'ok'}")
    if name == "attention":
        return "; ".join(f"{k}: {v['kernel']}" + (f" (predicted {v['predicted']})" if v.get("predicted") not in (
            None, v["kernel"]) else "") for k, v in r.items() if isinstance(v, dict))
    if name == "compile":
        return "; ".join(f"{k}: {v['first_step_s']} s first, {v['step_ms']} ms/step, {v['graphs']} graph(s)"
                         for k, v in r.items() if isinstance(v, dict))
    if name == "sync_audit":
        top = ", ".join(f"{site} x{n}" for site, n in list(r["by_site"].items())[:4]) or "none"
        return f"{r['syncs_in_2_steps']} syncs in 2 steps: {top}"
    if name == "memory_350m":
        return (f"estimate {r['estimate_gib']} GiB, measured {r.get('measured_max_allocated_gib')} GiB "
                f"(x{r.get('estimate_over_measured')})")
    if name == "trainer_125m":
        return (f"{r['tokens_per_s']['deepy']:,} tokens/s, MFU {(r['mfu'] or {}).get('deepy')}; "
                f"deepy/raw loop {r['deepy_over_raw']}")
    if name == "tiny_resume":
        return f"resumed steps {r['resumed_steps']} bit-equal: {r['bit_equal']}"
    if name == "gpu_libraries":
        return (r["tail"].strip().splitlines() or [""])[-1][:160]
    return ""


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| check | status | s (cap) | result |", "|---|---|---|---|"]
    lines += [f"| {name} | {r.get('status')} | {r['seconds']:.0f} ({r['cap_s']:.0f}) | {summary(name, r)} |"
              for name, r in results.items()]
    return "\n".join(lines)


def commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def main(argv: Sequence[str] | None = None) -> int:
    from megatron.errors import ConfigError

    o = parse(argv)
    try:
        plan = select([n.strip() for n in o.only.split(",") if n.strip()] or None, o.smoke)
    except ValueError as err:
        raise ConfigError(f"--only: {err}") from None
    if o.dry_run:
        print(describe(plan))
        return 0 if total_cap(plan) <= TEN_MINUTES else 1
    o.out.mkdir(parents=True, exist_ok=True)
    out = o.out.resolve()
    results: dict[str, dict[str, Any]] = {}
    for check in plan:
        print(f"deepy-gpu-check: {check.name} (cap {check.cap_s:.0f} s) ...", flush=True)
        results[check.name] = run_check(check, out, o.smoke)
        print(f"  {results[check.name].get('status')} in {results[check.name]['seconds']} s: "
              f"{summary(check.name, results[check.name])}", flush=True)
    device = results.get("environment", {}).get("device")
    header = {"device": device, "date": datetime.date.today().isoformat(), "commit": commit(), "smoke": o.smoke}
    (out / "results.json").write_text(json.dumps({**header, "checks": results}, indent=1, default=str) + "\n")
    text = (f"device: {device}; date: {header['date']}; commit: {header['commit']}"
            f"{' (smoke, CPU shapes)' if o.smoke else ''}\n\n{table(results)}\n")
    (out / "table.md").write_text(text)
    print(text, flush=True)
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


def cli() -> None:
    """The ``deepy-gpu-check`` console script: clean one-line errors, exit code 2."""
    from megatron.errors import run_guarded

    run_guarded(main)


if __name__ == "__main__":
    cli()
