#!/usr/bin/env python
"""The figures README.md shows, measured: run its recipes as written and compare what they print and log with
what the README states.

    python tools/bench/readme_figures.py               # ~6 min on 2 CPU cores; exit code 1 when the README differs
    python tools/bench/readme_figures.py --record      # also rewrite tests/e2e/readme_figures.json with what ran

In a scratch directory set up as ``tests/e2e/test_quick_start.py`` sets up its own (links to this checkout, a copy
of ``configs/``), it runs

1. the quick start's commands (``prepare_data.py``, 200 steps of ``configs/tiny.yml`` on 2 ranks, the plot);
2. the "Post-training" recipe block as written: preference pairs, SFT from the quick start's model, DPO from
   the SFT model, the plot; then its DPO command again on pairs built with ``--rejected other-document``
   (into ``data/pydocs_pref_other``), the variant the README compares it with. The scratch directory's
   ``docs/`` then holds the README's two images as its commands draw them;
3. in a second directory, the quick start shortened to the 60 steps ``test_quick_start.py`` runs
   (:data:`SHORTER`).

and compares

* the console transcript under "Watching a run": every line the README shows must be a line of the run's
  console, in the same order, after the timings (tokens/s, ms/iter, TFLOP/s, ETA, seconds), the run name and
  the rendezvous port are masked on both sides (:func:`masked`);
* the DPO paragraph's figures (:data:`DPO_SENTENCE`, :data:`OTHER_SENTENCE`) with the DPO runs' ``metrics.jsonl``,
  at the precision the README prints them.

``tests/e2e/readme_figures.json`` is the record of such a run. ``tests/unit/test_readme_figures.py`` holds the
README to it on every test run (no training), and ``tests/e2e/test_quick_start.py`` holds its own 60-step run to
the recorded one (1e-3): a change of the numbers fails there first, this script then measures the README's
figures again (``--record``) and says which to change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RECORD = REPO / "tests" / "e2e" / "readme_figures.json"
LINKED = ("deepy.py", "train.py", "generate.py", "eval.py", "prepare_data.py", "setup.py", "tools", "requirements")
"""What the scratch directory links to this checkout (``configs/`` is copied: the shortened run edits it)."""

ITERS = 60
SHORTER = {'"train_iters": 200': f'"train_iters": {ITERS}', '"lr_decay_iters": 200': f'"lr_decay_iters": {ITERS}',
           '"checkpoint_factor": 100': '"checkpoint_factor": 30', '"eval_interval": 100': '"eval_interval": 30'}
"""The quick start as ``tests/e2e/test_quick_start.py`` runs it: ``configs/tiny.yml`` edited to 60 steps."""

MASKS = (
    (re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}"), "<run>"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"tokens/s [\d,]+"), "tokens/s <t>"),
    (re.compile(r"ms/iter [\d.]+"), "ms/iter <t>"),
    (re.compile(r"TFLOP/s [\d.]+"), "TFLOP/s <t>"),
    (re.compile(r"ETA \S+"), "ETA <t>"),
    (re.compile(r" in (\d+h)?(\d+m)?[\d.]+s\b"), " in <t>"),
    (re.compile(r"[\d,]+ tokens/s on average"), "<t> tokens/s on average"),
)
"""What varies from run to run in a console line: timings, the run's name (its launch time), the port."""


def _phrase(pattern: str) -> re.Pattern[str]:
    """``pattern`` with each space matching any run of whitespace (the README wraps its lines anywhere)."""
    return re.compile(pattern.replace(" ", r"\s+"))


DPO_SENTENCE = _phrase(
    r"the DPO run ends with `eval/rewards/accuracy` \*\*(?P<accuracy_200>[\d.]+)\*\* on the held-out pairs "
    r"\((?P<accuracy_100>[\d.]+) at step 100\), `eval/lm_loss` (?P<loss_200>[\d.]+) against log 2 = 0\.693 at "
    r"the start, reward margin (?P<margin_200>[\d.]+)\.")
"""The README's sentence with the DPO run's figures (step 200 unless named)."""
OTHER_SENTENCE = _phrase(
    r"With `--rejected other-document` the tiny model stays near chance \((?P<other_accuracy_200>[\d.]+) at step "
    r"200, eval loss (?P<other_loss_200>[\d.]+)[;)]")
"""The README's sentence with the figures of the same DPO run on ``--rejected other-document`` pairs."""
METRIC_OF = {"accuracy": "eval/rewards/accuracy", "loss": "eval/lm_loss", "margin": "eval/rewards/margin"}


def masked(line: str) -> str:
    for pattern, replacement in MASKS:
        line = pattern.sub(replacement, line)
    return line.rstrip()


# ---------------------------------------------------------------- what the README states


def bash_commands(text: str) -> list[list[str]]:
    """The commands of each ```bash block (continuations joined, comments dropped, ``&&`` steps split)."""
    blocks: list[list[str]] = []
    for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", match.group(1))
        commands: list[str] = []
        for line in joined.splitlines():
            code = re.sub(r"(^|\s)#.*$", "", line).strip()
            commands.extend(" ".join(part.split()) for part in code.split("&&") if part.strip())
        blocks.append(commands)
    return blocks


def quick_start(text: str) -> list[str]:
    """The quick start's prepare, train and plot commands (README command 1, without the installs and the sample)."""
    first = bash_commands(text)[0]
    return [c for c in first if c.startswith(("python prepare_data.py", "python deepy.py train.py",
                                              "python tools/plot_metrics.py"))]


def post_training(text: str) -> list[str]:
    """The "Post-training" recipe: the block that builds the preference pairs."""
    return next(block for block in bash_commands(text) if any("build_preference_data.py" in c for c in block))


def transcript(text: str) -> list[str]:
    """The console lines "Watching a run" shows (the ``...`` lines, which stand for cut rows, left out)."""
    section = text[text.index("## Watching a run"):]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block is not None, "README.md: no ```text block under 'Watching a run'"
    return [line.rstrip() for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]


def stated_figures(text: str) -> dict[str, str]:
    """The DPO figures as the README prints them, e.g. ``{"accuracy_200": "0.825", ...}``."""
    found: dict[str, str] = {}
    for pattern in (DPO_SENTENCE, OTHER_SENTENCE):
        match = pattern.search(text)
        assert match is not None, f"README.md: no sentence matching {pattern.pattern[:60]}..."
        found.update(match.groupdict())
    return found


# ---------------------------------------------------------------- comparing


def transcript_differences(shown: Sequence[str], console: Sequence[str]) -> list[str]:
    """The README's lines (``shown``) that are not, in order, lines of ``console``, both masked."""
    lines = [masked(line) for line in console]
    out, at = [], 0
    for line in shown:
        want = masked(line)
        if want in lines[at:]:
            at = lines.index(want, at) + 1
            continue
        shape = re.sub(r"[\d.,]+", "#", want)  # the same kind of line (an evaluation row at the same step)
        near = [got for got in lines if re.sub(r"[\d.,]+", "#", got) == shape
                and got.split(" | ")[0] == want.split(" | ")[0]]
        said = ("the run printed it before the line above it" if want in lines else
                f"the run printed {near[0]!r}" if near else "the run printed no such line")
        out.append(f"the README shows {line!r}; {said}")
    return out


def figure_differences(stated: dict[str, str], measured: dict[str, float]) -> list[str]:
    """Figures the README prints that the measured values do not round to."""
    out = []
    for key, text in stated.items():
        decimals = len(text.split(".")[1]) if "." in text else 0
        value = measured.get(key)
        if value is None:
            out.append(f"{key}: the README says {text}, nothing was measured")
        elif f"{value:.{decimals}f}" != text:
            out.append(f"{key}: the README says {text}, the run gives {value:.{max(decimals, 4)}f}")
    return out


def differences(text: str, record: dict[str, Any]) -> list[str]:
    """Everything ``text`` (README.md) states that the measured ``record`` does not show."""
    return (transcript_differences(transcript(text), record["quick_start_console"])
            + figure_differences(stated_figures(text), record["dpo"]))


# ---------------------------------------------------------------- running the recipes


@dataclass(frozen=True)
class Scratch:
    root: Path

    @classmethod
    def make(cls, root: Path, shorten: bool = False) -> Scratch:
        root.mkdir(parents=True, exist_ok=True)
        for name in LINKED:
            (root / name).symlink_to(REPO / name)
        shutil.copytree(REPO / "configs", root / "configs")
        (root / "docs").mkdir()  # plots go here, never over the committed ones
        if shorten:
            tiny = root / "configs" / "tiny.yml"
            text = tiny.read_text()
            for old, new in SHORTER.items():
                assert text.count(old) == 1, old
                text = text.replace(old, new)
            tiny.write_text(text)
        return cls(root)

    def run(self, command: str) -> str:
        """``command`` (a README line starting with ``python``) here; its console output."""
        argv = shlex.split(command)
        assert argv[0] == "python", command
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        start = time.monotonic()
        print(f"$ {command}", flush=True)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=self.root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"exit code {proc.returncode} from {command}:\n{(proc.stdout + proc.stderr)[-4000:]}")
        print(f"  done in {time.monotonic() - start:.0f} s", flush=True)
        return proc.stdout + proc.stderr

    def rows(self, save: str) -> list[dict[str, Any]]:
        """The metrics rows of the run that saved into ``save``."""
        for config in sorted((self.root / "logs").glob("*/deepy_config.json")):
            if json.loads(config.read_text())["args"].get("save") == save:
                return [json.loads(line) for line in (config.parent / "metrics.jsonl").read_text().splitlines()]
        raise SystemExit(f"no run saved into {save} under {self.root / 'logs'}")


def at(rows: list[dict[str, Any]], key: str, iteration: int) -> float:
    return next(float(r[key]) for r in rows if r.get("iteration") == iteration and key in r)


def measure(work: Path, text: str) -> dict[str, Any]:
    """Run the README's recipes (module doc) under ``work``; the record of what they gave."""
    full = Scratch.make(work / "readme")
    prepare, train, plot = quick_start(text)
    full.run(prepare)
    console = full.run(train)
    full.run(plot)
    recipe = post_training(text)
    for command in recipe:
        full.run(command)
    dpo = next(c for c in recipe if "dpo.yml" in c and "deepy.py train.py" in c)
    full.run("python tools/datasets/build_preference_data.py --rejected other-document "
             "--output-dir data/pydocs_pref_other")
    full.run(dpo.replace("data/pydocs_pref/dpo.yml", "data/pydocs_pref_other/dpo.yml")
             .replace("checkpoints_dpo", "checkpoints_dpo_other"))
    rows, other = full.rows("checkpoints_dpo"), full.rows("checkpoints_dpo_other")
    figures = {f"{kind}_{step}": at(rows, METRIC_OF[kind], step)
               for kind, step in (("accuracy", 200), ("accuracy", 100), ("loss", 200), ("margin", 200))}
    figures |= {f"other_{kind}_200": at(other, METRIC_OF[kind], 200) for kind in ("accuracy", "loss")}

    short = Scratch.make(work / "shortened", shorten=True)
    short.run(prepare)
    short.run(train)
    short_rows = short.rows("checkpoints")
    return {
        "recorded": {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "python": platform.python_version(), "torch": _version("torch")},
        "quick_start_console": [masked(line) for line in console.splitlines() if line.strip()],
        "dpo": figures,
        "quick_start_60": {key: {str(r["iteration"]): r[key] for r in short_rows if key in r}
                           for key in ("train/lm_loss", "eval/lm_loss", "test/lm_loss")},
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"write what ran to {RECORD.relative_to(REPO)}")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="readme_figures_"))
    record = measure(work, text)
    if args.record:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {RECORD.relative_to(REPO)}")
    found = differences(text, record)
    for line in found:
        print(f"README.md differs: {line}")
    if not found:
        print("README.md states what its recipes give")
    print(f"scratch directory: {work}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
