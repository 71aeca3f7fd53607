"""deepy-gpu-check's plan: every part capped, the caps within ten minutes, --dry-run says so."""

from __future__ import annotations

import pytest

from tools.gpu_check import checks, cli
from tools.gpu_check.plan import PLAN, TEN_MINUTES, Check, describe, select, total_cap


def test_every_check_of_the_plan_is_implemented_and_the_caps_fit_ten_minutes() -> None:
    assert [c.name for c in PLAN] == list(checks.CHECKS)
    assert all(c.cap_s > 0 for c in PLAN)
    assert total_cap() <= TEN_MINUTES
    # the parts: environment, kernels, compile, tiny run with resume, overhead, memory, MFU, sync audit
    assert {"environment", "attention", "compile", "tiny_resume", "trainer_125m", "memory_350m",
            "sync_audit", "gpu_libraries"} == {c.name for c in PLAN}


def test_dry_run_prints_the_plan_and_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert all(c.name in text for c in PLAN)
    total_line = [line for line in text.splitlines() if line.startswith("total")]
    assert len(total_line) == 1 and f"{total_cap():.0f}s" in total_line[0]
    assert "fits ten minutes (600 s)" in text
    too_long = (*PLAN, Check(name="extra", cap_s=TEN_MINUTES, smoke=False, measures="-"))
    assert "does NOT fit ten minutes" in describe(too_long)


def test_smoke_runs_the_cpu_parts_and_only_names_the_chosen() -> None:
    assert [c.name for c in select(None, smoke=True)] == ["environment", "attention"]
    assert [c.name for c in select(["sync_audit", "environment"], smoke=True)] == ["environment", "sync_audit"]
    with pytest.raises(ValueError, match="unknown check"):
        select(["gpu_burn"], smoke=False)


def multi_gpu_commands(text: str, out: str) -> list[list[str]]:
    """The deepy.py arguments of each command of docs/benchmarks.md's multi-GPU block (an sbatch
    command's are the batch script's), with ``$O`` and ``$OUT`` filled in."""
    import re
    import shlex

    section = text.split("## Multi-GPU checks")[1]
    block = section.split("```bash")[1].split("```")[0]
    o_value = shlex.split(re.search(r"^O=(.*)$", block, re.M).group(1))[0]  # the block's own O="..."
    found = []
    for line in block.splitlines():
        if not line.strip() or line.startswith("#") or re.match(r"^[A-Z]+=", line) or line.startswith("nvidia-smi"):
            continue
        words = shlex.split(line.replace("$OUT", out).replace("$O", o_value).replace(";", " ; ").replace("&", " & "))
        start = (words.index("deepy.py") if "deepy.py" in words else words.index("tools/slurm/train.sbatch")) + 1
        args = words[start:]
        args = args[: min([args.index(t) for t in (";", "&") if t in args], default=len(args))]
        found.append(args if args[0] == "train.py" else ["train.py", *args])
    return found


def test_the_documented_multi_gpu_commands_pass_the_dry_run(tmp_path: "Path") -> None:  # noqa: F821
    """Every command docs/benchmarks.md lists for a multi-GPU node resolves as deepy.py --dry-run
    resolves it (in-process; the launch itself needs the GPUs)."""
    from pathlib import Path

    from megatron.app.deepy import parse_command, resolve

    text = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    commands = multi_gpu_commands(text, str(tmp_path))
    assert len(commands) == 9
    for args in commands:
        resolved = resolve(parse_command(["--dry-run", *args]))
        assert resolved.args.train_iters == 20, args
