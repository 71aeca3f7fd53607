"""Steps a dialect config needs done once before launch (a Levanter ``sft.py`` config's chat data converted
by ``tools/datasets/preprocess_data_with_mask.py``), run by ``deepy.py`` as child processes of Deepy's own
tools, as ``initialize_from_hf`` runs the import tool. A step is done when the file it writes last exists.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run(list(argv), capture_output=True, text=True, env=env)


def pending(dialect: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The steps of a resolved config's dialect record whose file is not written yet."""
    return [step for step in (dialect or {}).get("prepare", []) if not os.path.isfile(step["creates"])]


def command_line(step: dict[str, Any]) -> str:
    return "python " + shlex.join(step["argv"])


def run_steps(dialect: dict[str, Any] | None, in_place: bool, run: Runner = _run) -> list[str]:
    """Run every pending step; returns what was done (for the launch notes). ``in_place``: every rank runs
    deepy.py itself, so none converts (they would race): the user runs the command first. ``run`` executes a
    tool (tests inject their own)."""
    done = []
    for step in pending(dialect):
        if in_place:
            raise ConfigError(f"{step['why']}: with a launch where every rank runs deepy.py itself, convert first "
                              f"with {command_line(step)}, then launch again")
        proc = run([sys.executable, str(REPO / step["argv"][0]), *step["argv"][1:]])
        if proc.returncode != 0 or not os.path.isfile(step["creates"]):
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
            raise ConfigError(f"{step['why']}: {command_line(step)} failed:\n{tail}")
        done.append(f"{step['why']}: converted ({command_line(step)})")
    return done
