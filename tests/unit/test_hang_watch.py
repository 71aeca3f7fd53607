"""The hang watch (megatron/training/hang_watch.py) and the collective timeouts (megatron/torch_internals.py):
who is named stuck, a rank whose start-up outlives ``startup_hang_timeout`` ending itself with its stacks written,
and ``init_timeout_seconds``/``train_timeout_seconds`` reaching every process group (read back from torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


from megatron.logging.heartbeats import HANG_EXIT_CODE, Beat
from megatron.training.hang_watch import stuck_ranks

REPO = Path(__file__).resolve().parents[2]


def beat(rank: int, step: int, phase: str, written_at: float) -> Beat:
    return Beat(rank, "h", 100 + rank, step, phase, 0.0, written_at)


def test_a_rank_whose_heartbeat_stopped_is_the_stuck_one_even_when_level_with_the_others() -> None:
    now = 1000.0
    beats = [beat(0, 10, "forward/backward", now - 1), beat(1, 10, "forward/backward", now - 30),
             beat(2, 10, "forward/backward", now - 2)]  # fmt: skip
    stuck, why = stuck_ranks(beats, now, interval_s=2.0)
    assert [b.rank for b in stuck] == [1] and "heartbeat stopped" in why


def test_with_every_heartbeat_alive_the_rank_furthest_behind_is_named_else_all() -> None:
    now = 1000.0
    behind = [beat(0, 11, "data", now), beat(1, 10, "evaluation", now), beat(2, 10, "save", now)]
    stuck, why = stuck_ranks(behind, now, interval_s=2.0)
    assert [b.rank for b in stuck] == [2] and "furthest behind" in why  # step 10, save comes before evaluation
    level = [beat(0, 7, "forward/backward", now), beat(1, 7, "forward/backward", now)]
    stuck, why = stuck_ranks(level, now, interval_s=2.0)
    assert [b.rank for b in stuck] == [0, 1] and "collective" in why


def test_a_start_up_longer_than_startup_hang_timeout_ends_the_rank_with_its_stacks(tmp_path: Path) -> None:
    """A real process: its watch (startup_hang_timeout 1 s, hang_timeout off) fires while the main thread sleeps in
    start-up, writes the stacks, records the error and the event row, and exits with the hang code."""
    script = textwrap.dedent(f"""
        import time
        from megatron.training import hang_watch
        hang_watch.start({str(tmp_path)!r}, 3, startup_limit_s=1.0, limit_s=None, interval_s=0.2)
        def stuck_in_start_up():
            time.sleep(60)
        stuck_in_start_up()
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    stacks = (tmp_path / "hangs" / "stacks-rank3.txt").read_text()
    assert "no progress for 1s in start-up after step 0" in stacks and "stuck_in_start_up" in stacks
    assert "deepy: hang: rank 3 (host " in done.stderr and "in phase start-up" in done.stderr
    record = json.loads((tmp_path / "errors" / "rank3.json").read_text())
    assert record["message"].startswith("deepy: hang: rank 3 ")
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (row["event"], row["rank"], row["phase"], row["detected_by"]) == ("hang", 3, "start-up", 3)


def test_init_and_train_timeout_seconds_reach_every_process_group(tmp_path: Path) -> None:
    """init_timeout_seconds at the rendezvous and on the groups built after it (initialize), train_timeout_seconds
    on all of them after the first step (torchtitan's set_pg_timeouts): read back from each group's backend."""
    script = textwrap.dedent(f"""
        import os, datetime, torch.distributed as dist
        from megatron import torch_internals
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=77))
        dist.new_group([0])  # created with torch's default timeout, as initialize_model_parallel's are
        print(sorted({{t.total_seconds() for t in torch_internals.collective_timeouts()}}))
        torch_internals.set_collective_timeouts(datetime.timedelta(seconds=77))
        print(sorted({{t.total_seconds() for t in torch_internals.collective_timeouts()}}))
        torch_internals.set_collective_timeouts(datetime.timedelta(seconds=12), barrier_first=True)
        print(sorted({{t.total_seconds() for t in torch_internals.collective_timeouts()}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == "[77.0, 1800.0]"  # the world's, and torch's default for gloo on the later group
    assert lines[1:3] == ["[77.0]", "[12.0]"]


def test_a_straggler_is_a_rank_above_straggler_factor_times_the_median_of_the_ranks_means() -> None:
    """straggler_factor 1.5 over four ranks' mean local step times; the median is statistics.median's, by hand
    (0.11 and 0.12 in the middle: 0.115)."""
    from megatron.training.stragglers import stragglers

    means = [0.10, 0.12, 0.30, 0.11]
    slow, median = stragglers(means, factor=1.5)
    assert median == (0.11 + 0.12) / 2
    assert [rank for rank, _ in slow] == [2] and abs(slow[0][1] - 0.30 / 0.115) < 1e-12
    assert stragglers(means, factor=3.0)[0] == []  # 2.6x is not above 3x
    assert stragglers([0.2, 0.2], factor=1.5)[0] == []
    assert stragglers([0.001, 0.004], factor=1.5)[0] == []  # 1.6x the median, but 1.5 ms: jitter, not a straggler
