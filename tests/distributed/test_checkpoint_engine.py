"""Checkpoints through a real DeepSpeed engine on 2 gloo ranks (CPU, fp32, ZeRO).

Each scenario starts fresh rank processes (forked, as deepy's launcher forks them on CPU, from one
``python this_file.py --ranks N ...`` that imported torch and DeepSpeed once), so resume really
starts from disk: a tiny MLP with dropout, a data position that is a pure function of the step,
and the checkpoint manager the training loop uses. Covered here, without the full model:
exact resume, kill -9 before the commit marker, dp2 -> dp1 and ZeRO-1 -> ZeRO-2 through universal
checkpoints, SIGTERM on one rank -> all ranks save and exit 0, and a write failure on one rank
(file-size limit, at ZeRO-3 with the weight average's gathered file) -> every rank exits non-zero with a clear
message, previous checkpoint intact.
"""

from __future__ import annotations

import argparse
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8
pytestmark = pytest.mark.slow


# --- the worker (runs in each rank's process) ---------------------------------------------------
def worker(opts: argparse.Namespace) -> int:
    import logging
    import resource

    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher
    from megatron.checkpointing.commit import KeepRule, RetentionPolicy
    from megatron.errors import CheckpointError
    from megatron.deepspeed_internals import defer_muon_kernel_compiles, skip_shared_memory_comm_op
    from megatron.mpu import topology

    skip_shared_memory_comm_op()  # as train.py: no /dev/shm buffers left behind by DeepSpeed's op
    defer_muon_kernel_compiles()  # as train.py: ZeRO's Muon check without TorchInductor

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    topology.initialize_model_parallel(1, 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if opts.fsize_limit_rank == rank:
        # a "disk full" on one rank only: writes past 2 KiB fail with EFBIG (every shard is larger)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, opts.width), torch.nn.Tanh(), torch.nn.Dropout(opts.dropout), torch.nn.Linear(opts.width, 16)
    )
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": opts.zero},
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=topology)
    torch.manual_seed(99 + rank)  # per-rank dropout streams: resume must restore them exactly
    import random

    import numpy

    random.seed(rank)  # every stream a checkpoint holds starts the same in every launch
    numpy.random.seed(rank)

    step_now = [0]
    if opts.fake_clock:
        # rank 0: 100 s per step; rank 1: a clock that never moves. Only rank 0 decides, so both
        # must still save together.
        seconds_per_step = 100.0 if rank == 0 else 0.0

        def clock() -> float:
            return step_now[0] * seconds_per_step
    else:
        clock = time.monotonic
    policy = RetentionPolicy(
        train_iters=opts.steps,
        checkpoint_factor=opts.factor or None,
        keep_last_n_checkpoints=opts.keep_last,
        save_interval_s=250.0 if opts.fake_clock else None,
        keep=[KeepRule(every=4)] if opts.fake_clock else (),
        clock=clock,
    )
    from megatron import object_store
    from megatron.checkpointing.remote import Mirror, staging_dir

    save, load, mirror, load_mirror = opts.save, opts.load, None, None
    if save and object_store.is_remote(save):  # as CheckpointManager.from_config does for a bucket `save`
        mirror = Mirror(save, 5 * 1024 * 1024, is_save=True)
        save = str(staging_dir(save, opts.staging))
    elif save and opts.s3_path:
        mirror = Mirror.for_s3_path(opts.s3_path, save, 5 * 1024 * 1024)
    if load and object_store.is_remote(load):
        load_mirror = mirror if mirror is not None and mirror.url == load else Mirror(load, 5 * 1024 * 1024, True)
        load = str(staging_dir(load, opts.staging))
    manager = CheckpointManager(
        save=save,
        load=load,
        async_save=opts.async_save,
        mirror=mirror,
        load_mirror=load_mirror,
        policy=policy,
        args_dict={"hidden_size": 64, "num_layers": 2},
        config_files={"configs/tiny.yml": "hidden_size: 64\n"},
        iteration=opts.iteration,
        no_load_optim=opts.no_load_optim,
        preemption=PreemptionWatcher().install(),
        before_commit=kill_before_commit(opts.kill_before_commit),
    )
    if opts.ema:  # the weight average's file in every checkpoint: under ZeRO-3 a gather every rank takes part in
        from megatron.training.model_averaging import ModelAverage

        average = ModelAverage(engine.module, 0.9, optimizer=engine.optimizer, writer=rank == 0)
        manager.rank_files.append(average.save)
    try:
        start = manager.load(engine)
        losses: dict[int, float] = {}
        consumed = start.consumed_samples
        for step in range(start.iteration + 1, opts.steps + 1):
            step_now[0] = step
            # the data position is a pure function of consumed samples (as the real sampler)
            gen = torch.Generator().manual_seed(consumed)
            x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
            y = torch.randn(GLOBAL_BATCH, 16, generator=gen)
            per = GLOBAL_BATCH // world
            out = engine(x[rank * per : (rank + 1) * per])
            loss = ((out - y[rank * per : (rank + 1) * per]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            if opts.ema:
                average.update()
            consumed += GLOBAL_BATCH
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[step] = mean.item() / world
            print(f"STEP {step}", flush=True)
            if opts.sleep:
                time.sleep(opts.sleep)
            if manager.maybe_save(engine, step, consumed).stop:
                print(f"PREEMPTED at {step}", flush=True)
                break
        manager.wait("the end of the run")
    except CheckpointError as err:
        print(f"deepy: checkpoint error: {err}", file=sys.stderr, flush=True)
        return 2
    if rank == 0 and opts.out:
        Path(opts.out).write_text(json.dumps({"losses": losses, "start": start.iteration, "notes": start.notes}))
    return 0


def kill_before_commit(step: int | None) -> Callable[[int], None] | None:
    """The crash-safety seam: SIGKILL this rank between writing checkpoint ``step`` and its marker."""
    if step is None:
        return None

    def kill(saving: int) -> None:
        if saving == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


# --- the launcher (runs in pytest) ----------------------------------------------------------------
def _free_port() -> int:
    # imported here: the ranks re-import this module in processes whose sys.path lacks tests/
    from ports import free_port  # tests/ports.py: a port range per xdist worker

    return free_port()


class Ranks:
    """The ranks of one scenario: forked by one launcher process that imported torch and DeepSpeed once
    (as deepy's own launcher does on CPU); each rank writes its output to a file of its own."""

    def __init__(self, launcher: subprocess.Popen[str], logdir: Path, world: int) -> None:
        self.launcher, self.logdir, self.world = launcher, logdir, world
        self._pids: list[int] = []

    def log(self, rank: int) -> str:
        path = self.logdir / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def pid(self, rank: int) -> int:
        assert self.launcher.stdout is not None
        while len(self._pids) < self.world:
            line = self.launcher.stdout.readline()
            assert line.startswith("PID "), line or self.launcher.wait()
            self._pids.append(int(line.split()[2]))
        return self._pids[rank]

    def wait_for_line(self, rank: int, prefix: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in self.log(rank).splitlines()):
            assert time.monotonic() < deadline and self.launcher.poll() is None, self.log(rank)
            time.sleep(0.05)

    def wait(self, timeout: float = 300) -> tuple[list[int], list[str]]:
        out, _ = self.launcher.communicate(timeout=timeout)
        logs = [self.log(rank) for rank in range(self.world)]
        codes_file = self.logdir / "codes.json"
        assert self.launcher.returncode == 0 and codes_file.exists(), (out, logs)
        return json.loads(codes_file.read_text()), logs


def launch(world: int, *worker_args: str, env: dict[str, str] | None = None) -> Ranks:
    logdir = Path(tempfile.mkdtemp(prefix="deepy-ckpt-engine-"))
    launcher = subprocess.Popen(
        [sys.executable, __file__, "--ranks", str(world), "--port", str(_free_port()), "--logdir", str(logdir),
         "--worker", *worker_args],
        env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Ranks(launcher, logdir, world)


def fork_ranks(world: int, port: int, logdir: Path, worker_argv: list[str], opts: argparse.Namespace) -> int:
    """The launcher process: import torch and DeepSpeed once, fork ``world`` ranks, report each one's pid
    and, once all have ended, their exit codes (``-N``: killed by signal N) in ``codes.json``."""
    from megatron.initialize import exit_process
    from megatron.launcher.local_ranks import preload

    forkable = preload()  # False where DeepSpeed drives a device: the ranks then exec fresh interpreters
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            out = os.open(logdir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
            if not forkable:
                os.execv(sys.executable, [sys.executable, __file__, "--worker", *worker_argv])
            try:
                exit_process(worker(opts))
            except BaseException:  # noqa: BLE001  (a crash is this rank's output and exit code, as a process's)
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
        pids.append(pid)
        print(f"PID {rank} {pid}", flush=True)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    (logdir / "codes.json").write_text(json.dumps(codes))
    return 0


def wait_all(ranks: Ranks, timeout: float = 300) -> tuple[list[int], list[str]]:
    return ranks.wait(timeout)


def run(world: int, *worker_args: str, env: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    return wait_all(launch(world, *worker_args, env=env))


def losses_of(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}


def assert_close(got: dict[int, float], want: dict[int, float], tol: float) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in got:
        assert abs(got[step] - want[step]) <= tol * max(1.0, abs(want[step])), (step, got[step], want[step])


def test_exact_resume_after_kill_during_save(tmp_path: Path) -> None:
    common = ["--dropout", "0.1", "--steps", "12"]
    codes, logs = run(2, *common, "--out", str(tmp_path / "ref.json"))
    assert codes == [0, 0], logs
    reference = losses_of(tmp_path / "ref.json")

    save = tmp_path / "ckpt"
    # saves at 4 (committed) and 8 (killed with SIGKILL after the files, before the marker)
    codes, logs = run(
        2, *common, "--save", str(save), "--factor", "4", "--kill-before-commit", "8"
    )
    assert codes == [-signal.SIGKILL, -signal.SIGKILL], logs
    assert (save / "global_step8").is_dir() and not (save / "global_step8" / "COMMITTED").exists()
    assert (save / "latest").read_text().strip() == "global_step4"

    codes, logs = run(2, *common, "--save", str(save), "--load", str(save), "--factor", "4",
                      "--out", str(tmp_path / "resumed.json"))  # fmt: skip
    assert codes == [0, 0], logs
    assert "skipping incomplete checkpoint" in logs[0]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["start"] == 4
    # new processes, same losses: weights, Adam moments, dropout RNG and data position all restored
    assert_close(losses_of(tmp_path / "resumed.json"), {s: v for s, v in reference.items() if s > 4}, 1e-6)
    assert (save / "global_step8" / "COMMITTED").exists()  # the incomplete one was rewritten
    meta = json.loads((save / "global_step12" / "deepy_meta.json").read_text())
    assert meta["iteration"] == 12 and meta["consumed_samples"] == 12 * GLOBAL_BATCH
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1, "pipeline": False, "replicas": 1}
    resolved = (save / "global_step12" / "configs" / "resolved.yml").read_text()  # the run's values, for GPT-NeoX
    assert "hidden_size: 64\n" in resolved and "num_layers: 2\n" in resolved

    # no_load_optim: same weights (the first resumed loss matches), fresh Adam moments (then not)
    codes, logs = run(2, *common, "--load", str(save), "--iteration", "8", "--no-load-optim",
                      "--out", str(tmp_path / "no_optim.json"))  # fmt: skip
    assert codes == [0, 0], logs
    no_optim = losses_of(tmp_path / "no_optim.json")
    assert abs(no_optim[9] - reference[9]) < 1e-6
    assert abs(no_optim[10] - reference[10]) > 1e-6


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (relative path -> size, modification time): what a run wrote there."""
    return {str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(root.rglob("*")) if path.is_file()}


def test_layout_changes_through_universal_checkpoints(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    common = ["--steps", "12", "--dropout", "0"]
    codes, logs = run(2, *common, "--save", str(save), "--factor", "6", "--out", str(tmp_path / "ref.json"))
    assert codes == [0, 0], logs
    tail = {s: v for s, v in losses_of(tmp_path / "ref.json").items() if s > 6}

    # an iteration that does not exist is a clear error listing what does
    codes, logs = run(1, *common, "--load", str(save), "--iteration", "5")
    assert codes == [2], logs
    assert "committed iterations: 6, 12" in logs[0]

    # ZeRO-1 -> ZeRO-2 at dp2 without a `save`: rank 0 converts into a temporary directory (removed after
    # loading), then DeepSpeed re-partitions it; nothing is written into the checkpoint's directory
    before = files_under(save)
    codes, logs = run(2, *common, "--load", str(save), "--iteration", "6", "--zero", "2",
                      "--out", str(tmp_path / "zero2.json"))  # fmt: skip
    assert codes == [0, 0], logs
    assert "layout changed" in logs[0]
    assert files_under(save) == before
    from megatron.checkpointing.universal import conversion_dir

    assert not conversion_dir(save / "global_step6", None).exists()  # removed once loaded
    assert_close(losses_of(tmp_path / "zero2.json"), tail, 1e-5)

    # dp2 -> dp1 rewound in its own directory (load = save, iteration 6): converted beside the checkpoint
    # (<tag>_universal), and the step-12 checkpoint of this new trajectory replaces the dp2 run's
    codes, logs = run(1, *common, "--save", str(save), "--load", str(save), "--iteration", "6", "--factor", "6",
                      "--out", str(tmp_path / "dp1.json"))  # fmt: skip
    assert codes == [0], logs
    assert (save / "global_step6_universal" / "COMMITTED").exists()
    assert "layout changed" in logs[0]
    assert_close(losses_of(tmp_path / "dp1.json"), tail, 1e-5)
    assert json.loads((save / "global_step12" / "deepy_meta.json").read_text())["layout"]["dp"] == 1
    assert (save / "latest").read_text().strip() == "global_step12"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("global_step12")) == ["global_step12"]


def test_sigterm_on_one_rank_saves_and_exits_zero(tmp_path: Path) -> None:
    """With background saves (the synchronous ones: tests/e2e/test_crash_safety.py): the stop waits for the write, so
    the process ends with the checkpoint committed."""
    save = tmp_path / "ckpt"
    ranks = launch(2, "--steps", "500", "--sleep", "0.2", "--save", str(save), "--dropout", "0", "--async-save",
                   "--width", "100000")
    # wait for training to be under way, then preempt rank 1 only
    ranks.wait_for_line(0, "STEP 3")
    os.kill(ranks.pid(1), signal.SIGTERM)
    codes, logs = wait_all(ranks)
    assert codes == [0, 0], logs
    stopped = [line for line in logs[0].splitlines() if line.startswith("PREEMPTED at")]
    assert stopped, logs[0]
    step = int(stopped[0].split()[-1])
    assert (save / "latest").read_text().strip() == f"global_step{step}"
    assert (save / f"global_step{step}" / "COMMITTED").exists()
    assert "writing it in the background" in logs[0], logs[0]


def test_failed_save_stops_loudly_and_keeps_previous(tmp_path: Path) -> None:
    """At ZeRO-3 with the weight average: the ranks whose engine files were written must not go on alone into the
    average's gather (every rank writes its files, or none does), which left them waiting for rank 1."""
    save = tmp_path / "ckpt"
    common = ("--zero", "3", "--ema", "--dropout", "0", "--factor", "2", "--save", str(save))
    codes, logs = run(2, "--steps", "4", *common)
    assert codes == [0, 0], logs
    assert (save / "global_step4" / "deepy_ema" / "tp00_pp00.pt").exists()
    # resume with a file-size limit on rank 1: its optimizer shard cannot be written
    codes, logs = run(2, "--steps", "8", *common, "--load", str(save), "--fsize-limit-rank", "1")
    assert codes == [2, 2], logs
    assert "saving checkpoint" in logs[0] and "failed on rank(s) [1]" in logs[0], logs[0]
    assert (save / "latest").read_text().strip() == "global_step4"
    assert (save / "global_step4" / "COMMITTED").exists()
    assert not (save / "global_step6" / "COMMITTED").exists()


def test_time_based_saves_follow_rank_0_and_temporaries_are_replaced(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    codes, logs = run(2, "--steps", "12", "--save", str(save), "--fake-clock", "--dropout", "0")
    assert codes == [0, 0], logs
    # every 250 fake seconds a temporary save (3, 7, 11), permanent ones at multiples of 4; each
    # temporary is deleted once the next checkpoint is committed
    saved = [line for line in logs[0].splitlines() if "saved " in line and "checkpoint" in line]
    assert len(saved) == 6, logs[0]
    assert sorted(p.name for p in save.glob("global_step*")) == ["global_step12", "global_step4", "global_step8"]
    kinds = {p.name: json.loads((p / "COMMITTED").read_text())["kind"] for p in save.glob("global_step*")}
    assert kinds == {"global_step4": "permanent", "global_step8": "permanent", "global_step12": "permanent"}


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    codes, logs = run(2, "--steps", "2", "--factor", "2", "--save", str(save))
    assert codes == [0, 0], logs
    import torch

    model_file = save / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=False)
    state["payload"] = _Exploit(tmp_path / "pwned")
    torch.save(state, model_file)
    # same layout: DeepSpeed's own loader; another layout: the universal converter
    for world in (2, 1):
        codes, logs = run(world, "--steps", "4", "--load", str(save))
        assert set(codes) == {2}, logs
        assert re.search(r"refusing to load \S*global_step2/mp_rank_00_model_states.pt", logs[0]), logs[0]
        assert "posix.system" in logs[0]
    assert not (tmp_path / "pwned").exists()


def checkpoint_tensors(ckpt: Path) -> dict[str, Any]:
    """Every tensor of every ``.pt`` file of a checkpoint, by file and key path."""
    import torch

    found: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if torch.is_tensor(value):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)

    for path in sorted(ckpt.rglob("*.pt")):
        walk(str(path.relative_to(ckpt)), torch.load(path, weights_only=False, map_location="cpu"))
    return found


def test_background_save_equals_synchronous_save(tmp_path: Path) -> None:
    common = ["--steps", "4", "--factor", "2", "--dropout", "0.1"]
    codes, logs = run(2, *common, "--save", str(tmp_path / "sync"))
    assert codes == [0, 0], logs
    codes, logs = run(2, *common, "--save", str(tmp_path / "async"), "--async-save")
    assert codes == [0, 0], logs
    assert "writing it in the background" in logs[0], logs[0]
    for tag in ("global_step2", "global_step4"):
        sync, background = checkpoint_tensors(tmp_path / "sync" / tag), checkpoint_tensors(tmp_path / "async" / tag)
        assert sorted(sync) == sorted(background) and len(sync) > 10, (sorted(sync), sorted(background))
        for key, tensor in sync.items():
            assert tensor.dtype == background[key].dtype and tensor.equal(background[key]), key
        assert (tmp_path / "async" / tag / "COMMITTED").exists()
    assert (tmp_path / "async" / "latest").read_text().strip() == "global_step4"


def test_kill_during_background_writes_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    """SIGKILL of every rank at a random moment while a background save writes (a node lost): the newest
    committed checkpoint is whole, and the next launch resumes from it; three trials, then a run to the end."""
    import random

    from megatron.checkpointing import commit

    save = tmp_path / "ckpt"
    # ~10M parameters: each save writes ~120 MB per rank, long enough to be killed inside it
    common = ["--steps", "40", "--factor", "2", "--width", "300000", "--async-save", "--save", str(save),
              "--load", str(save), "--dropout", "0"]
    draw = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "") + str(time.time()))
    committed_before: int | None = None
    interrupted = 0
    for trial in range(3):
        ranks = launch(2, *common)
        if committed_before is not None:
            ranks.wait_for_line(0, "INFO deepy.checkpoint: resumed from")
            assert f"global_step{committed_before} (iteration {committed_before}" in ranks.log(0), ranks.log(0)
        background = ranks.log(0).count("writing it in the background")
        deadline = time.monotonic() + 120
        # inside the 2nd, 3rd or 4th save of this launch: the one before it is committed (a save waits for the last)
        while ranks.log(0).count("writing it in the background") < background + 2 + trial:
            assert time.monotonic() < deadline and ranks.launcher.poll() is None, ranks.log(0)
            time.sleep(0.01)
        time.sleep(draw.uniform(0.0, 0.4))
        for rank in range(2):
            os.kill(ranks.pid(rank), signal.SIGKILL)
        codes, logs = wait_all(ranks)
        assert codes == [-signal.SIGKILL, -signal.SIGKILL], logs
        tag, _ = commit.newest_committed(save)
        assert tag is not None, sorted(p.name for p in save.iterdir())
        assert checkpoint_tensors(save / tag)  # every file of it reads back
        listing = commit.list_checkpoints(save)
        interrupted += bool(listing.incomplete) or tag != commit.tag_for(max(listing.steps + [0]))
        committed_before = commit.step_of(tag)
    assert committed_before is not None
    assert interrupted >= 1, "no kill landed inside a background save (each left its save committed)"
    end = ["--steps", str(committed_before + 2), *common[2:]]
    codes, logs = run(2, *end, "--out", str(tmp_path / "end.json"))
    assert codes == [0, 0], logs
    assert json.loads((tmp_path / "end.json").read_text())["start"] == committed_before


def test_checkpoints_in_object_storage(tmp_path: Path, s3_server: Any) -> None:
    """GPT-NeoX's s3_path leaves its layout in the bucket, object for object the local files; a run saving into a
    bucket resumes on another machine (its staging directory gone) on the uninterrupted curve."""
    s3_server.bucket("deepy-ckpt")
    local = tmp_path / "neox_run"
    common = ["--steps", "6", "--dropout", "0.1"]
    codes, logs = run(2, *common, "--save", str(local), "--factor", "3", "--s3-path", "s3://deepy-ckpt/mirror",
                      "--async-save", "--out", str(tmp_path / "ref.json"))  # fmt: skip
    assert codes == [0, 0], logs
    reference = losses_of(tmp_path / "ref.json")
    # <s3_path>/<basename of save>/<tag>/<relative path> (gpt-neox megatron/checkpointing.py: upload_checkpoint)
    objects = s3_server.objects("deepy-ckpt", "mirror/")
    local_files = {str(p.relative_to(local)): p.read_bytes() for p in sorted(local.rglob("*"))
                   if p.is_file() and p.parent != local}
    assert sorted(objects) == sorted(f"neox_run/{name}" for name in local_files) and len(local_files) > 10
    for name, data in local_files.items():
        assert objects[f"neox_run/{name}"] == data, name

    url = "s3://deepy-ckpt/runs/a"
    codes, logs = run(2, "--steps", "3", "--dropout", "0.1", "--factor", "3", "--save", url,
                      "--staging", str(tmp_path / "node1"))  # fmt: skip
    assert codes == [0, 0], logs
    stored = s3_server.objects("deepy-ckpt", "runs/a/")
    assert stored["latest"] == b"global_step3\n" and "global_step3/COMMITTED" in stored
    # an upload that never finished (no marker) is not loaded: the committed one before it is
    s3_server.client().put_object(Bucket="deepy-ckpt", Key="runs/a/global_step5/deepy_meta.json", Body=b"{}")
    shutil.rmtree(tmp_path / "node1")
    codes, logs = run(2, *common, "--factor", "3", "--save", url, "--load", url, "--staging", str(tmp_path / "node2"),
                      "--out", str(tmp_path / "resumed.json"))  # fmt: skip
    assert codes == [0, 0], logs
    assert json.loads((tmp_path / "resumed.json").read_text())["start"] == 3
    assert_close(losses_of(tmp_path / "resumed.json"), {s: v for s, v in reference.items() if s > 3}, 1e-6)
    stored = s3_server.objects("deepy-ckpt", "runs/a/")
    assert stored["latest"] == b"global_step6\n" and "global_step6/COMMITTED" in stored


class _Exploit:
    """Unpickling this runs a shell command: what a weights-only load must never do."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.target}",))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--factor", type=int, default=0)
    parser.add_argument("--keep-last", type=int, default=None)
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fsize-limit-rank", type=int, default=-1)
    parser.add_argument("--fake-clock", action="store_true")
    parser.add_argument("--no-load-optim", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--s3-path")
    parser.add_argument("--staging")
    parser.add_argument("--kill-before-commit", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--logdir", type=Path)
    args = parser.parse_args()
    if args.ranks:
        worker_argv = sys.argv[sys.argv.index("--worker") + 1:]
        code = fork_ranks(args.ranks, args.port, args.logdir, worker_argv, args)
        sys.stdout.flush()
        os._exit(code)  # no teardown of the preloaded torch and DeepSpeed (as deepy's launcher)
    from megatron.initialize import exit_process

    exit_process(worker(args))  # as train.py: no interpreter teardown abort (-6)
