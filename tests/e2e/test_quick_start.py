"""The README's quick start in a directory of its own, and everything README.md and docs/ show after it.

One module fixture runs the quick start's commands as README.md writes them (less the installs):
``prepare_data.py`` builds the built-in corpus, ``deepy.py train.py configs/tiny.yml
configs/local_setup.yml`` trains on 2 CPU ranks and ``tools/plot_metrics.py`` draws the curves. The
directory holds a copy of ``configs/`` whose ``tiny.yml`` trains 60 steps instead of 200 (the only
change); scripts and tools are links to this checkout. The tests then read what a user sees: the loss
falls, the console (a header, a line per log interval, a summary, nothing of DeepSpeed's own), one copy
of an error every rank hits, the plot, and every command the docs show (``docs_commands.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_commands import (
    MADE_BY_A_RUN,
    NEEDS,
    RUN,
    Command,
    documented_commands,
    not_here,
    run_deepy,
    run_tool,
    sbatch_counts,
    tool_path,
    untagged_commands,
)

pytestmark = pytest.mark.slow

from tools.bench.readme_figures import ITERS, RECORD, Scratch, transcript

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class QuickStart:
    root: Path
    train: Command
    """The quick start's training command."""
    console: str
    """What the training command printed (stdout and stderr, as a terminal shows them)."""


def quick_start_commands() -> list[Command]:
    """README command 1's steps after the installs: prepare, train, plot, sample."""
    return [c for c in documented_commands((REPO / "README.md",)) if c.source == documented_commands()[0].source
            and c.argv[:3] != ["python", "-m", "pip"]]


def environment() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DEEPY_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> QuickStart:
    # the benchmark's scratch clone: the repository's programs linked, configs copied with tiny.yml shortened
    root = Scratch.make(tmp_path_factory.mktemp("clone"), shorten=True).root
    prepare, train, plot, sample = quick_start_commands()
    assert [c.argv[1] for c in (prepare, train, plot)] == ["prepare_data.py", "deepy.py", "tools/plot_metrics.py"]
    assert sample.argv[2] == "generate.py"  # checked with the other commands (a dry run)
    console = ""
    for step in (prepare, train):
        done = subprocess.run([sys.executable, *step.argv[1:]], cwd=root, env=environment(), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{step.text}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        console = done.stdout + done.stderr
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code, said = run_tool(plot.argv[1], plot.argv[2:], parse=False)
    finally:
        os.chdir(cwd)
    assert code == 0, said
    return QuickStart(root, train, console)


def test_tiny_config_trains_on_pydocs(quick_start: QuickStart) -> None:
    rows = [json.loads(line) for line in (quick_start.root / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/lm_loss" in r]
    evals = [r for r in rows if "eval/lm_loss" in r]
    assert [r["iteration"] for r in train] == list(range(10, ITERS + 1, 10))
    for key in ("consumed_samples", "train/lr", "train/grad_norm", "throughput/tokens_per_sec"):
        assert all(key in r for r in train), key
    assert train[-1]["consumed_samples"] == ITERS * 8  # global batch 8 = 4 per rank x 2 ranks
    assert [r["iteration"] for r in evals] == [30, 60]
    first, last = train[0]["train/lm_loss"], train[-1]["train/lm_loss"]
    # a uniform guess over the 8192-token vocabulary costs ln(8192) = 9.0; the model must learn
    assert last < first - 1.0, [r["train/lm_loss"] for r in train]
    assert evals[-1]["eval/lm_loss"] < evals[0]["eval/lm_loss"]
    assert any(r.get("test/lm_loss") is not None for r in rows)
    # one directory per run: its metrics and the resolved config deepy.py wrote for it
    runs = [p for p in (quick_start.root / "logs").iterdir() if p.is_dir()]
    assert len(runs) == 1 and {p.name for p in runs[0].iterdir()} >= {"metrics.jsonl", "deepy_config.json"}
    # issue 42 item 18: tools/bench/readme_figures.py measures the README's figures and records them with this
    # 60-step run's (tests/e2e/readme_figures.json; tests/unit/test_readme_figures.py holds the README to the
    # record): a change that moves the losses fails here, then measure the README's figures again
    for key, want in json.loads(RECORD.read_text())["quick_start_60"].items():
        got = {str(r["iteration"]): r[key] for r in rows if key in r}
        off = {step: (got.get(step), value) for step, value in want.items()
               if step not in got or abs(got[step] - value) > 1e-3}
        assert sorted(got) == sorted(want) and not off, (
            f"{key} moved (step: (this run, recorded)): {off}; run `python tools/bench/readme_figures.py --record` "
            "and change the README figures it names")


def test_the_console_of_a_two_rank_run(quick_start: QuickStart) -> None:
    lines = quick_start.console.splitlines()
    run_dir = next((quick_start.root / "logs").glob("2*")).name
    header = lines.index(f"run {run_dir}: metrics and config in logs/{run_dir}/")
    assert lines[header + 1].startswith("  model       624,384 parameters (100,096 without embeddings), all trainable")
    assert lines[header + 2] == "  layout      2 ranks: data 2 x tensor 1 x pipeline 1; ZeRO 0; fp32"
    assert lines[header + 3].startswith("  batch       8 sequences x 128 tokens = 1,024 tokens per step")
    schedule = re.fullmatch(rf"  schedule    {ITERS} steps, {ITERS * 1024:,} tokens = ([\d.]+) epochs of the train "
                            r"split \(([\d,]+) tokens in ([\d,]+) documents\)", lines[header + 4])
    assert schedule, lines[header + 4]
    # the train split, counted here from the corpus and local_setup.yml's split
    from megatron.data.build import split_ranges
    from megatron.data.indexed_dataset import MMapIndexedDataset

    sizes = MMapIndexedDataset(str(quick_start.root / "data" / "pydocs" / "pydocs_text_document")).sizes
    lo, hi = split_ranges("960,20,20", len(sizes))[0]
    assert schedule.groups() == (f"{ITERS * 1024 / sizes[lo:hi].sum():.2f}", f"{sizes[lo:hi].sum():,}", f"{hi - lo:,}")
    interval = [line for line in lines if re.match(r"iteration \d+/60 \| loss ", line)]
    assert [int(line.split()[1].split("/")[0]) for line in interval] == list(range(10, ITERS + 1, 10))
    assert all(" | ETA " in line for line in interval[:-1]) and "ETA" not in interval[-1]
    summary = next(i for i, line in enumerate(lines) if line.startswith(f"done: {ITERS} steps (1-{ITERS}, "))
    assert lines[summary + 1].startswith("  last        train loss ")
    assert lines[summary + 2:summary + 4] == [f"  checkpoint  checkpoints/global_step{ITERS}",
                                              f"  metrics     logs/{run_dir}/metrics.jsonl"]
    assert lines[-1] == lines[summary + 3]  # the summary ends the run's output
    # the README's transcript (a 200-step run) shows these lines as this run prints them
    shown = transcript((REPO / "README.md").read_text())
    for start in ("  model ", "  layout ", "  batch "):  # not the output line: 30-step evaluations here
        line = next(line for line in shown if line.startswith(start))
        assert line in lines, (line, [got for got in lines if got.startswith(start)])
    schedule_shown = next(line for line in shown if line.startswith("  schedule"))
    split = re.search(r"epochs of the train split \(.*\)$", schedule_shown)  # the corpus' train split
    assert split and lines[header + 4].endswith(split.group(0)), (split, lines[header + 4])
    # nothing of DeepSpeed's own, nor our internals (tiny.yml leaves steps_per_print at DeepSpeed's 10)
    for noise in (r"^steps: \d+ loss", r"SEED_LAYERS=", r"^stage=\d+ layers=", r"Setting accelerator to CPU",
                  r"\[INFO\]", r"\[WARNING\]", r"megatron\.launcher\.local_ranks", r"^deepy: rank=", r"skipped \d",
                  r"split has no data", r"distutils", r"Traceback"):
        assert not re.search(noise, quick_start.console, re.M), noise
    assert "steps_per_print" not in (REPO / "configs" / "tiny.yml").read_text()


def test_the_fine_tune_example_writes_metrics_and_is_the_file_the_commands_test_uses() -> None:
    """Issue 42 item 18: the Hugging Face fine-tune recipe (``deepy_model.yml`` + ``my_data_and_schedule.yml``,
    no local_setup.yml) wrote no metrics.jsonl and did not say so: the README's example sets ``log_dir`` (the
    header of a run without it says so, ``tests/unit/test_console.py``), and the file the documented commands are
    checked with is that example."""
    import yaml

    readme = (REPO / "README.md").read_text()
    example = re.search(r"`my_data_and_schedule.yml` what\s+is left to you, for instance `(\{[^`]*\})`", readme)
    assert example, "README.md: the my_data_and_schedule.yml example moved"
    shown = yaml.safe_load(example.group(1))
    assert shown.get("log_dir") == "logs", shown
    assert yaml.safe_load(NEEDS["my_data_and_schedule.yml"]) == shown


def test_an_error_every_rank_hits_is_printed_once(quick_start: QuickStart, tmp_path: Path) -> None:
    """Both ranks resume from a checkpoint whose file was cut in half: one message, and which ranks had it."""
    broken = tmp_path / "broken"
    shutil.copytree(quick_start.root / "checkpoints", broken)
    shutil.rmtree(broken / f"global_step{ITERS}")
    (broken / "latest").write_text("global_step30")
    layer = sorted((broken / "global_step30").glob("layer_02-*"))[0]
    layer.write_bytes(layer.read_bytes()[: layer.stat().st_size // 2])
    proc = subprocess.run([sys.executable, *quick_start.train.argv[1:], f"load={broken}", f"save={broken}"],
                          cwd=quick_start.root, env=environment(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    said = [line for line in out.splitlines() if line.startswith("deepy: checkpoint error: ")]
    assert len(said) == 1 and layer.name in said[0], out
    assert "deepy: ranks 0, 1 failed with the error above" in out and "Traceback" not in out


def test_the_plot_shows_what_the_run_logged(quick_start: QuickStart) -> None:
    sys.path.insert(0, str(REPO))
    from tools import plot_metrics

    png = quick_start.root / "docs" / "tiny_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = plot_metrics.read_runs(quick_start.root / "logs")
    assert [run.label for run in runs] == ["LM: tiny"]  # from the run's config files, not its timestamp
    fig = plot_metrics.build_figure(runs)
    titles = [ax.get_title() for ax in fig.axes]
    # an fp32 run: no loss-scale panel; train, eval and test losses share the one cross-entropy axis
    assert titles == ["cross-entropy loss (nats per token)", "learning rate", "gradient norm (before clipping)",
                      "tokens / s (all devices)"]
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["train", "eval", "test"]
    assert fig._suptitle.get_text() == f"LM: tiny: {ITERS} steps"


SHORTER_TAGS = {"global_step100": "global_step30", "global_step200": f"global_step{ITERS}"}
"""The quick start's checkpoints the docs name, in the shortened run (saves at 30 and 60, not 100 and 200)."""


def check(command: Command, quick: Command) -> str | None:
    """None when ``command`` works here as written, else what is wrong."""
    argv = [re.sub(r"global_step(100|200)\b", lambda m: SHORTER_TAGS[m.group(0)], a) for a in command.argv]
    if not_here(argv) is not None:
        return None
    if argv[0] == "sbatch":
        script = next(a for a in argv[1:] if not a.startswith("-"))
        if not Path(script).is_file():
            return f"{script} does not exist"
        at = argv.index(script)
        given = argv[at + 1:]
        counts = [f"{k}={v}" for k, v in sbatch_counts(argv[1:at], Path(script)).items()
                  if not any(a.startswith(f"{k}=") for a in given)]  # the command's own num_gpus= wins
        # what the batch script runs inside the allocation (outside one: its size from sbatch's options)
        return _dry_run(["train.py", *argv[at + 1:], "launcher=slurm", "deepspeed_slurm=true", *counts], train=True)
    if argv[0] in ("torchrun", "deepspeed"):
        return _external(argv)
    if argv[:2] == ["python", "deepy.py"]:
        if len(argv) == 2:
            return None  # `python deepy.py` in a sentence: the program's name
        if any(made in command.text for made in MADE_BY_A_RUN):
            return _loads(argv[2:])
        # a training launch (not one that is itself a dry run) must train: not reuse the quick start's run
        train = "train.py" in argv[2:4] and "--dry-run" not in argv
        return _dry_run(argv[2:], train=train, quick=command.text == quick.text)
    script, args = tool_path(argv)
    if not Path(script).is_file():
        return f"{script} does not exist"
    parse = (script not in RUN or any(made in args for made in MADE_BY_A_RUN)
             or (script.endswith("train_speed.py") and "--dry-run" not in args))
    code, said = run_tool(script, args, parse=parse)
    differ = "--diff" in args and code == 1  # as diff does: 1 says the two differ (README says so)
    return None if code == 0 or differ else f"exit code {code}: {said[-1500:]}"


def _dry_run(args: list[str], train: bool, quick: bool = False) -> str | None:
    code, said = run_deepy(args)
    # a cluster launcher (this machine has none of its tools), or a run sized for a GPU node (more memory than
    # this machine's, which its CPU ranks would share): every check but the machine's
    here = "not installed here" in said or "refuses to start ranks as root" in said
    if code != 0 and (here or ("on this machine =" in said and "allow_memory_overcommit" in said)):
        code, said = _resolve_only(args)
    if code != 0:
        return f"--dry-run: exit code {code}: {said.strip().splitlines()[-1]}"
    if train and not quick and "a launch would exit at once" in said:
        return "the run is already finished here: give it its own save/load"
    load = re.search(r'^load\s+"?([^"\s]+)"?\s', said, re.M)  # the resolved table's row (JSON-quoted value)
    if train and not quick and load and load.group(1) == "checkpoints":
        return "it loads the quick start's checkpoints/: give it its own save/load (initialize_from to start from it)"
    return None


def _external(argv: list[str]) -> str | None:
    """``torchrun [its flags] train.py CONFIG...`` or ``deepspeed [its flags] train.py CONFIG...`` (docs/torchrun.md):
    the launcher's own parser takes the command, and every worker's checks pass at the world size it starts (the
    agreement between the ranks and training itself: tests/e2e/test_torchrun.py)."""
    from megatron.app.deepy import parse_command, resolve
    from megatron.app.external_launch import strip_launcher_flags
    from megatron.errors import DeepyError

    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(argv[1:])
        nodes = int(str(parsed.nnodes).split(":")[-1])
        world = nodes * int(parsed.nproc_per_node)
        script, args = parsed.training_script, parsed.training_script_args
    else:
        from deepspeed.launcher.runner import fetch_hostfile, parse_args

        parsed = parse_args(argv[1:])
        world = sum(fetch_hostfile(parsed.hostfile).values())
        script, args = parsed.user_script, parsed.user_args
    if not Path(script).is_file():
        return f"{script} does not exist"
    try:
        resolve(parse_command([script, *strip_launcher_flags(args)]), world=world)
    except DeepyError as err:
        return f"a worker would refuse: {err.kind}: {err.message}"
    return None


def _loads(args: list[str]) -> str | None:
    """The config loads (files, keys, types), for a command whose inputs another documented run makes."""
    from megatron.app.deepy import parse_command
    from megatron.errors import DeepyError
    from megatron.neox_arguments.loading import load_config

    try:
        command = parse_command(args)
        load_config(command.config_files, command.overrides, command.conf_dir, command.dialect_flags)
    except DeepyError as err:
        return f"loading its config: {err.kind}: {err.message}"
    return None


def _resolve_only(args: list[str]) -> tuple[int, str]:
    from megatron.app.deepy import parse_command, resolve
    from megatron.errors import DeepyError

    try:
        resolve(parse_command(args))
    except DeepyError as err:
        return 2, f"deepy: {err.kind}: {err.message}"
    return 0, ""


def test_every_documented_command_runs_as_written(quick_start: QuickStart, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: about 60 commands, read from README.md and docs/ on each run."""
    monkeypatch.chdir(quick_start.root)
    for name, content in NEEDS.items():
        (quick_start.root / name).write_text(content)
    assert untagged_commands() == []  # a command shown outside a ```bash block would escape this test
    commands = documented_commands()
    assert len(commands) >= 40
    failed = [f"{c.source}: {c.text}\n    -> {problem}" for c in commands
              if (problem := check(c, quick_start.train)) is not None]
    assert not failed, "\n".join(failed)
