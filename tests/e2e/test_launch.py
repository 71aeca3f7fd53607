"""Real launches through deepy.py and DeepSpeed's runner: ranks start, find their place, report it.

Each launch costs ~10 s of imports per rank on a small CPU box, so there are only three: two ranks,
a 2x2x1 (tp x pp x dp) grid on four ranks, and a rank that fails with exit code 3. The worker is
train.py's start-up without the training (which needs a tokenized corpus): read the resolved config,
``initialize`` (torch.distributed on gloo, tp/pp/dp groups), exit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.mpu import build_topology

REPO = Path(__file__).resolve().parents[2]
DEEPY = str(REPO / "deepy.py")
TOPOLOGY_WORKER = """\
import sys
import torch.distributed
from megatron.errors import run_guarded
from megatron.initialize import initialize
from megatron.neox_arguments import load_resolved
from megatron.neox_arguments.run_config import RunConfig
import train  # the real worker's argv parsing (--deepy_config, --local_rank)

def main():
    options = train.parse_worker_argv(sys.argv[1:])
    run = RunConfig.from_resolved(load_resolved(options.deepy_config))
    initialize(run.parallel, run.training.seed, announce=True)
    # wait for every rank to finish its groups: a rank that exits at once can close its gloo sockets while a
    # peer is still connecting to it ("Connection closed by peer"), as a real worker's next collective prevents
    torch.distributed.barrier()
    return 0

run_guarded(main)
"""
TINY = str(REPO / "configs" / "tiny.yml")
# no corpus needed: the worker stops before reading data (deepy checks data files before launch)
NO_DATA = ("use_dummy_dataset=true", "tokenizer_type=CharLevelTokenizer", "log_dir=logs", "save=ckpt")
LINE = re.compile(r"^deepy: rank=(\d+) tp=(\d+) pp=(\d+) dp=(\d+) world=(\d+)$", re.MULTILINE)

pytestmark = pytest.mark.slow


def deepy(script: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # no master_port: deepy picks a free one, so these runs and anyone else's on this machine coexist
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, DEEPY, "--verbose", script, TINY, *NO_DATA, *overrides],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=540,
    )


def coordinates(out: str) -> set[tuple[int, int, int, int, int]]:
    found = [tuple(int(x) for x in match) for match in LINE.findall(out)]
    assert len(found) == len(set(found)), out
    return set(found)  # type: ignore[arg-type]


def expected_grid(tp: int, pp: int, world: int) -> set[tuple[int, int, int, int, int]]:
    topo = build_topology(tp, pp, world)
    grid = set()
    for rank in range(world):
        coord = topo.get_coord(rank)
        grid.add((rank, coord.model, coord.pipe, coord.data, world))
    return grid


@pytest.fixture()
def worker(tmp_path: Path) -> str:
    path = tmp_path / "topology_worker.py"
    path.write_text(TOPOLOGY_WORKER)
    return str(path)


def test_two_ranks_report_a_consistent_topology(tmp_path: Path, worker: str) -> None:
    done = deepy(worker, "num_gpus=2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert coordinates(done.stdout) == {(0, 0, 0, 0, 2), (1, 0, 0, 1, 2)}
    # the workers were handed the resolved config file, not a blob
    written = list(tmp_path.rglob("deepy_config.json"))
    assert len(written) == 1
    assert f"--deepy_config {written[0].relative_to(tmp_path)}" in done.stdout


def test_four_ranks_fill_the_tp_pp_dp_grid(tmp_path: Path, worker: str) -> None:
    done = deepy(worker, "model_parallel_size=2", "pipe_parallel_size=2", "num_gpus=4", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = coordinates(done.stdout)
    assert got == expected_grid(tp=2, pp=2, world=4)
    assert {(tp, pp) for _, tp, pp, _, _ in got} == {(0, 0), (1, 0), (0, 1), (1, 1)}


def test_a_failing_rank_sets_deepys_exit_code(tmp_path: Path) -> None:
    worker = tmp_path / "fail_on_rank1.py"
    worker.write_text(
        "import os, sys, time\n"
        "from megatron.neox_arguments import load_resolved\n"
        "resolved = load_resolved(sys.argv[sys.argv.index('--deepy_config') + 1])\n"
        "assert resolved.args.world_size == 2\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(120)  # rank 0 must be torn down by the launcher, not finish on its own\n"
    )
    done = deepy(str(worker), "num_gpus=2", cwd=tmp_path)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exit code 3" in done.stdout
