"""The restart loop's decisions (megatron/launcher/restarts.py) on real launches of tiny commands: a failure is
launched again from a fresh plan until max_restarts are used, a repeated failure without progress is said, a
refused input (exit code 2) and a clean finish are not restarted, and in-place launches refuse max_restarts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.launcher.plan import LaunchPlan
from megatron.launcher.restarts import RestartPolicy, check_restartable, run_with_restarts
from megatron.logging.heartbeats import RESTARTS_ENV


def plan_of(code: str, run_dir: Path, in_place: bool = False) -> LaunchPlan:
    return LaunchPlan(argv=[sys.executable, "-c", code], mode="local", world_size=1,
                      config_path=str(run_dir / "deepy_config.json"), in_place=in_place)  # fmt: skip


def test_a_failing_launch_is_relaunched_until_the_budget_is_spent(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every launch exits 3: two restarts, each from a new plan (replan called twice), the second one said to have
    made no progress, then deepy gives up with code 3 and names the checkpoint; each launch sees the restarts before
    it in its environment; each restart is an event row."""
    seen = tmp_path / "seen.txt"
    code = f"import os; open({str(seen)!r}, 'a').write(os.environ.get({RESTARTS_ENV!r}, '-') + '\\n'); raise SystemExit(3)"
    plans = []

    def replan() -> LaunchPlan:
        plans.append(plan_of(code, tmp_path))
        return plans[-1]

    policy = RestartPolicy(2, str(tmp_path), lambda: "ckpt/global_step4 (step 4)")
    assert run_with_restarts(plan_of(code, tmp_path), replan, {}, policy) == 3
    said = capsys.readouterr().out
    assert len(plans) == 2 and said.count("deepy: starting 1 rank") == 3
    assert "deepy: restart 1 of 2: " in said and "resuming from checkpoint ckpt/global_step4 (step 4)" in said
    assert "deepy: restart 2 of 2: " in said and "no step was completed since the last restart" in said
    assert "deepy: giving up after 2 restarts (max_restarts=2)" in said
    assert "the last committed checkpoint is ckpt/global_step4 (step 4)" in said
    envs = seen.read_text().splitlines()
    assert envs[0] == "-" and len(json.loads(envs[1])) == 1 and len(json.loads(envs[2])) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["restart"], r["max_restarts"]) for r in rows] == [("restart", 1, 2), ("restart", 2, 2)]
    assert all("iteration" not in r for r in rows)  # kept by a resumed run's truncation


@pytest.mark.parametrize(("code", "said"), [("raise SystemExit(2)", "a rank refused its input"),
                                             ("pass", None)])  # fmt: skip
def test_a_refused_input_or_a_clean_finish_is_not_restarted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            code: str, said: str | None) -> None:  # fmt: skip
    def replan() -> LaunchPlan:
        raise AssertionError("not relaunched")

    policy = RestartPolicy(3, str(tmp_path), lambda: None)
    expected = 2 if said else 0
    assert run_with_restarts(plan_of(code, tmp_path), replan, {}, policy) == expected
    out = capsys.readouterr().out
    assert "restart 1" not in out and (said is None or said in out)


def test_in_place_launches_refuse_max_restarts_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_restarts=1 \(cli\): this launch has srun/mpirun start deepy.py"):
        check_restartable(plan_of("pass", tmp_path, in_place=True), 1, "max_restarts=1 (cli)")
    check_restartable(plan_of("pass", tmp_path, in_place=True), 0, "max_restarts=0")
    check_restartable(plan_of("pass", tmp_path), 2, "max_restarts=2")


def test_the_dry_run_shows_the_resilience_settings_and_refuses_bad_ones_by_name() -> None:
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    base = [sys.executable, "deepy.py", "--dry-run", "train.py", "configs/tiny.yml", "configs/local_setup.yml"]
    done = subprocess.run([*base, "max_restarts=2", "hang_timeout=5s", "straggler_factor=2"], cwd=repo,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    block = done.stdout[done.stdout.index("Resilience:"):]
    assert "up to 2 relaunch(es) from the last checkpoint when a rank dies or hangs (max_restarts)" in block
    assert "hang_timeout=5s, startup_hang_timeout=45min" in block
    assert "init_timeout_seconds=3600 (through the first step), train_timeout_seconds=1800 (after it)" in block
    assert "straggler_factor=2.0 over straggler_window=20 steps" in block
    for bad, named in (("max_restarts=-1", "max_restarts"), ("hang_timeout=soon", "hang_timeout='soon'"),
                       ("hang_timeout=1h", "hang_timeout='1h' (command line) is not shorter than "
                                           "train_timeout_seconds=1800"),
                       ("straggler_factor=1.0", "straggler_factor")):  # fmt: skip
        refused = subprocess.run([*base, bad], cwd=repo, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and named in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
