"""Shared pieces of the launch tests (local, Slurm, MPI, pdsh): a tiny training config, a cheap
stand-in worker, starting deepy.py in the background, reading its output, and checking that no
process of a run survives it.

Every launch test trains the same tiny model on dummy data with dropout on (so the RNG state must
survive a stop and resume), 2 ranks, data parallel: the loss curve does not depend on how the ranks
were started, so one uninterrupted local run (``conftest.py``'s ``two_runs_at_once``) is the
reference for the stopped-and-resumed runs under every launcher.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEEPY = str(REPO / "deepy.py")
TRAIN = str(REPO / "train.py")
TRAIN_ITERS = 30

MODEL_YML = f"""\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
norm: layernorm
pos_emb: rotary
optimizer: {{type: Adam, params: {{lr: 0.001, betas: [0.9, 0.95], eps: 1.0e-8}}}}
min_lr: 0.0001
lr_decay_style: cosine
warmup: 0.1
train_batch_size: 8
gradient_clipping: 1.0
weight_decay: 0.0
hidden_dropout: 0.1
attention_dropout: 0.0
precision: fp32
train_iters: {TRAIN_ITERS}
lr_decay_iters: {TRAIN_ITERS}
eval_interval: 1000
eval_iters: 1
seed: 1234
num_workers: 0
log_interval: 1
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
pipe_parallel_size: 1
model_parallel_size: 1
zero_optimization: {{stage: 1}}
"""
# checkpoints only when stopped (and at the end): resumes continue from where a stop saved
SAVE = ("save=ckpt", "load=ckpt", "checkpoint_factor=1000")

# A stand-in for a rank that starts in a second: it reports where it is (rank, world, rendezvous,
# Slurm node), then waits for a stop request as train.py's ranks do (SIGTERM or SIGUSR1), records
# which signal came, and exits 0. STUBBORN_WORKER ignores stop requests (a rank stuck in a
# collective), so only a hard stop ends it.
STOP_WORKER = """\
import json, os, signal, socket, sys, time
from pathlib import Path
from megatron.launcher.environment import distributed_env

env = distributed_env(os.environ, prefer_slurm="SLURM_STEP_ID" in os.environ)
run_dir = Path(sys.argv[sys.argv.index("--deepy_config") + 1]).parent
got = []
STUBBORN = False


def take(num, frame):
    got.append(signal.Signals(num).name)
    # later requests are ignored: Python puts SIG_DFL back while it exits, so a second SIGUSR1 then (two host
    # names of this one machine in a hostfile: pdsh's pkill runs on it twice) would kill the exiting worker
    signal.signal(num, signal.SIG_IGN)


for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, signal.SIG_IGN if STUBBORN else take)
place = {**env, "pid": os.getpid(), "host": socket.gethostname(), "node": os.environ.get("SLURM_NODEID"),
         "secret_seen": os.environ.get("WANDB_API_KEY"), "pythonpath": os.environ.get("PYTHONPATH", "")}
(run_dir / f"ready.{env['RANK']}").write_text(json.dumps(place))
deadline = time.time() + 300
while not got and time.time() < deadline:
    time.sleep(0.05)
(run_dir / f"stopped.{env['RANK']}").write_text(got[0] if got else "timeout")
sys.exit(0 if got else 5)
"""
STUBBORN_WORKER = STOP_WORKER.replace("STUBBORN = False", "STUBBORN = True")
# A rank still starting (importing, building its model): no stop handler yet, so SIGUSR1's default action
# would kill it. It says it runs (started.<rank>) and would take minutes.
SLOW_START_WORKER = """\
import os, sys, time
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--deepy_config") + 1]).parent
(run_dir / f"started.{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(300)
"""

# Rank 1 fails with exit code 3; rank 0 would wait two minutes, so the launcher must stop it.
FAIL_WORKER = """\
import os, sys, time
from megatron.launcher.environment import distributed_env

if distributed_env(os.environ, prefer_slurm="SLURM_STEP_ID" in os.environ)["RANK"] == "1":
    sys.exit(3)
time.sleep(120)
"""


def write_model(tmp: Path) -> Path:
    path = tmp / "model.yml"
    path.write_text(MODEL_YML)
    return path


def write_script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def deepy_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("DEEPY_DEBUG", None)
    return {**env, **(extra or {})}


def deepy_argv(script: str | Path, *args: str) -> list[str]:
    return [sys.executable, DEEPY, str(script), *args]


def run_deepy(tmp: Path, script: str | Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(deepy_argv(script, *args), cwd=tmp, env=deepy_env(env), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


class Background:
    """deepy.py (or any command) running in the background, its output collected line by line."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        # its own session, as a shell job would be: the test signals deepy alone, as a user would
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _drain(self, timeout: float) -> bool:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            return True
        if line is None:
            self._queue.put(None)
            return False
        self.lines.append(line)
        return True

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match[str]:
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = regex.search(self.output)
            if match:
                return match
            if not self._drain(0.2) and self.proc.poll() is not None:
                break
        raise AssertionError(f"never saw {pattern!r}:\n{self.output[-4000:]}")

    def wait(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout=timeout)
        while self._drain(5):
            pass
        return code

    @property
    def output(self) -> str:
        """Everything printed so far."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)
                break
            self.lines.append(line)
        return "".join(self.lines)


def start_deepy(tmp: Path, script: str | Path, *args: str, env: dict[str, str] | None = None) -> Background:
    return Background(deepy_argv(script, *args), tmp, deepy_env(env))


def losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["iteration"]: row["train/lm_loss"] for row in rows if "train/lm_loss" in row}


def assert_curves_match(got: dict[int, float], want: dict[int, float], tol: float = 1e-6) -> None:
    assert got, "no losses logged"
    missing = sorted(set(got) - set(want))
    assert not missing, f"steps {missing} not in the reference"
    bad = {s: (got[s], want[s]) for s in got if abs(got[s] - want[s]) > tol * max(1.0, abs(want[s]))}
    assert not bad, f"loss differs at steps {bad}"


def latest_step(ckpt: Path) -> int:
    latest = (ckpt / "latest").read_text().strip()
    assert (ckpt / latest / "COMMITTED").exists(), f"{latest} is not committed"
    return int(latest.removeprefix("global_step"))


def survivors(tmp: Path, wait_s: float = 0.0) -> list[str]:
    """Processes (other than this test) running in ``tmp`` or naming it on their command line."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cwd = os.readlink(entry / "cwd")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and (cwd == str(tmp) or cwd.startswith(f"{tmp}/") or str(tmp) in cmdline):
                found.append(f"{entry.name}: {cmdline[:200]}")
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def wait_for_files(paths: list[Path], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        time.sleep(0.1)
    raise AssertionError(f"never appeared: {[str(p) for p in paths if not p.exists()]}")


def ready_files(
    run_root: Path, world: int, run: Background | None = None, timeout: float = 300
) -> list[dict[str, object]]:
    """The places the stop workers of the one run under ``run_root`` reported, by rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run is not None and run.proc.poll() is not None:
            run.wait()
            raise AssertionError(f"the run ended (exit code {run.proc.returncode}) before its ranks reported:\n"
                                 f"{run.output[-4000:]}")  # fmt: skip
        found = sorted(run_root.rglob("ready.*"))
        if len(found) >= world:
            time.sleep(0.1)  # written whole: each is one small write
            return [json.loads(p.read_text()) for p in sorted(found, key=lambda p: int(p.suffix[1:]))]
        time.sleep(0.1)
    raise AssertionError(f"only {len(list(run_root.rglob('ready.*')))} of {world} ranks reported under {run_root}"
                         + (f":\n{run.output[-4000:]}" if run is not None else ""))  # fmt: skip


def stopped_signals(run_root: Path) -> list[str]:
    return [p.read_text() for p in sorted(run_root.rglob("stopped.*"))]


def command_lines_containing(text: str) -> list[str]:
    """Every process whose command line contains ``text`` (what ``ps`` would show anyone)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found
