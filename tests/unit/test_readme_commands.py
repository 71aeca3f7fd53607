"""The README's two Quick start commands, as .ci/run extracts and runs them, do what the README says."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commands() -> list[str]:
    spec = importlib.util.spec_from_file_location("readme_commands", REPO / ".ci" / "readme_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.readme_commands((REPO / "README.md").read_text())


def steps(command: str) -> list[list[str]]:
    return [shlex.split(part) for part in command.split("&&")]


def test_there_are_two_commands_and_the_second_runs_the_whole_suite() -> None:
    found = commands()
    assert len(found) == 2
    assert steps(found[1]) == [["python", "-m", "pytest", "-q"]]


def test_the_first_installs_pinned_torch_first_then_prepares_trains_plots_and_samples() -> None:
    first = steps(commands()[0])
    scripts = [s[1] for s in first if s[0] == "python" and s[1] != "-m"]
    installs = [s for s in first if s[:3] == ["python", "-m", "pip"]]
    # torch alone and first: an unpinned torch would pull CUDA wheels
    assert installs[0] == ["python", "-m", "pip", "install", "-r", "requirements/requirements-torch.txt"]
    rest = installs[1]
    for req in ("requirements/requirements.txt", "requirements/requirements-dev.txt"):
        assert req in rest
    assert (REPO / "requirements/requirements-torch.txt").read_text().count("torch==") == 1
    assert scripts == ["prepare_data.py", "deepy.py", "tools/plot_metrics.py", "deepy.py"]
    train, plot, sample = (s for s in first if s[0] == "python" and s[1] in ("deepy.py", "tools/plot_metrics.py"))
    assert train[2:] == ["train.py", "configs/tiny.yml", "configs/local_setup.yml"]
    assert plot[-2:] == ["-o", "docs/tiny_curves.png"] and "docs/tiny_curves.png" in (REPO / "README.md").read_text()
    assert sample[2] == "generate.py" and "text_gen_type=unconditional" in sample
    for path in [*train[3:], *sample[3:5]]:
        assert (REPO / path).is_file(), path
