"""Every command README.md and docs/*.md show, extracted and checked in a directory where the README's
quick start has run (``tests/e2e/test_quick_start.py``).

What counts as a command: each line of a ```bash block (a trailing backslash continues it, ``# ...``
comments and ``&&``-chained steps split off), and every inline ```python ...```/```deepy-...```/```sbatch
...``` span that is not a template (``...``, ``…`` or ``<...>`` in it). How each is checked, cheapest
first, in the test's own process (a Python start costs ~3 s here):

- ``python deepy.py ...``: ``deepy.py --dry-run`` with the same arguments (every check a launch makes,
  files and the checkpoint in ``load`` included); a training command must not be one that would
  exit at once (the quick start's finished checkpoint reused), except the quick start's own;
- a tool (``python tools/...``, ``python -m tools....``, ``deepy-...`` console scripts): run for real
  when it is quick (:data:`RUN`), else its command line parsed by the tool's own argparse parser;
- ``sbatch tools/slurm/train.sbatch CONFIG...``: the batch script exists and the configs resolve
  with ``launcher=slurm`` (what the script passes);
- installs and the test suite itself (:data:`NOT_HERE`): run by ``.ci/run`` as the README writes them.

Files a command names that the user brings (a hostfile, a prompts file) are written first
(:data:`NEEDS`), with the content the docs describe.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

NOT_HERE = {
    ("python", "-m", "pip"): "installs: .ci/run runs the README's install command on a fresh machine",
    ("python", "-m", "pytest"): "the suite itself (.ci/run)",
    ("nvidia-smi",): "names the GPU of the GPU runbook (docs/benchmarks.md)",
    ("docker",): "builds the image (docs/kubernetes_skypilot.md): tests/unit/test_cluster_manifests.py checks the "
                 "Dockerfile",
    ("kubectl",): "needs a Kubernetes cluster: tests/unit/test_cluster_manifests.py validates the manifests",
    ("sky",): "needs a cloud: tests/unit/test_cluster_manifests.py validates the SkyPilot task",
}
"""Commands (by their first words) checked elsewhere or only meaningful on other hardware."""

RUN = {"tools/plot_metrics.py", "tools/ckpts/inspect_checkpoint.py", "tools/datasets/preprocess_data.py",
       "tools/datasets/build_preference_data.py", "tools/bench/train_speed.py", "tools/ckpts/convert_neox_to_hf.py",
       "tools/ckpts/convert_hf_to_neox.py", "tools/datasets/preprocess_data_with_mask.py"}
"""Tools quick enough to run for real on the quick start's outputs (train_speed: its --dry-run only); the
others take minutes (benchmarks) and have their command line parsed."""

MADE_BY_A_RUN = {"checkpoints_lora": "the LoRA training command before it",
                 "reference_logps=sft_ref": "the precompute command before it (docs/generation.md)",
                 "initialize_from=checkpoints_sft": "the SFT run before it (README, post-training)",
                 "checkpoints_dpo": "the DPO run before it, whose run the plot picks by its save (README)"}
"""Inputs that documented runs make, which this test only dry-runs: a tool reading them has its command
line parsed, a deepy.py command its config loaded (files, keys, types) without the checks that open them."""

NEEDS: dict[str, str] = {
    "hosts": "localhost slots=2\n",
    "prompts.txt": "def fibonacci(n):\nThe os module\n",
    "my-run.yaml": (  # a Levanter config (docs/dialects.md): its data, model and trainer sections
        "data:\n  train_urls: [data/pydocs/pydocs.jsonl]\n  cache_dir: cache/levanter\n"
        "  tokenizer: data/pydocs/tokenizer.json\n"
        "model:\n  type: gpt2\n  hidden_dim: 64\n  num_heads: 4\n  num_layers: 2\n  seq_len: 128\n"
        "trainer:\n  mp: p=f32,c=f32\n  per_device_parallelism: 4\n"
        "optimizer:\n  learning_rate: 1e-3\n"
    ),
    "my_data_and_schedule.yml": (  # README, Hugging Face interop: what deepy_model.yml leaves to the user
        "data_path: data/pydocs/pydocs_text_document\nsplit: '960,20,20'\nnum_gpus: 4\ntrain_micro_batch_size_per_gpu: 4\n"
        "train_iters: 100\nlr: 1.0e-4\nsave: checkpoints_ft\ncheckpoint_factor: 50\nlog_dir: logs\n"
    ),
}
"""Files the user brings, by the name a command gives them, and what the docs say they hold."""


def not_here(argv: list[str]) -> str | None:
    return next((why for words, why in NOT_HERE.items() if tuple(argv[: len(words)]) == words), None)


@dataclass(frozen=True)
class Command:
    source: str
    """``README.md:12``: where it is shown."""
    text: str

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.text)
        while words and ASSIGNMENT.match(words[0]):  # `CUDA_VISIBLE_DEVICES=2,3 python ...`: the program's environment
            words = words[1:]
        return words


def _logical_lines(block: str, first_line: int) -> Iterator[tuple[int, str]]:
    pending, start = "", first_line
    for offset, line in enumerate(block.splitlines()):
        if not pending:
            start = first_line + offset
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def _without_comment(line: str) -> str:
    # a comment starts at a '#' that follows whitespace (or starts the line) outside quotes
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


TEMPLATE = re.compile(r"\.\.\.|…|<[^>]+>|\$\{?[A-Z_]+\}?")
"""What marks an inline span as a template: an ellipsis, a ``<placeholder>``, a shell variable."""
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$")
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def _assigned(line: str) -> tuple[str, str] | None:
    """``O="a=1 b=2"`` on a line of its own: a variable later lines of the block use (name, words)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    if len(words) == 1 and (match := re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", words[0], re.S)):
        return match.group(1), match.group(2)
    return None
INLINE = re.compile(r"`((?:python |deepy-[a-z-]+ |sbatch )[^`]+)`")


def documented_commands(files: tuple[Path, ...] = DOCS) -> list[Command]:
    found: list[Command] = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(path.parents[1] if path.parent.name == "docs" else path.parent).as_posix()
        for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
            first = text.count("\n", 0, match.start(1)) + 1
            variables: dict[str, str] = {}  # the block's own assignments, as a shell would expand them
            for line_no, line in _logical_lines(match.group(1), first):
                code = _without_comment(line)
                if (assigned := _assigned(code)) is not None:
                    variables[assigned[0]] = assigned[1]
                    continue
                code = VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), code)
                for part in code.split("&&"):
                    if part.strip():
                        found.append(Command(f"{name}:{line_no}", " ".join(part.split())))
        for match in INLINE.finditer(text):
            body = match.group(1)
            if not TEMPLATE.search(body):
                line_no = text.count("\n", 0, match.start()) + 1
                found.append(Command(f"{name}:{line_no}", " ".join(body.split())))
    return found


PROGRAM = re.compile(r"\s*(python3? |sbatch |deepy-[a-z-]+ |bash |nvidia-smi )")


def untagged_commands(files: tuple[Path, ...] = DOCS) -> list[str]:
    """Command lines in fenced blocks not marked ```bash (which :func:`documented_commands` would miss)."""
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"```([a-z]*)\n(.*?)```", text, re.S):
            if match.group(1) != "bash":
                found += [f"{path.name}: {line.strip()}" for line in match.group(2).splitlines() if PROGRAM.match(line)]
    return found


def console_scripts() -> dict[str, str]:
    """``deepy-plot-metrics`` -> ``tools.plot_metrics`` (setup.py's entry points)."""
    setup = (REPO / "setup.py").read_text()
    return dict(re.findall(r'"(deepy-[a-z-]+) = ([a-z_.]+):cli"', setup))


class Parsed(Exception):
    """Raised by the patched ``parse_args``: the tool accepted its command line."""


@contextlib.contextmanager
def parse_only() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        original(self, args, namespace)  # a bad command line exits 2 here, with argparse's message
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def tool_path(argv: list[str]) -> tuple[str, list[str]]:
    """(repository-relative script path, its arguments) of a tool command."""
    if argv[0].startswith("deepy-"):
        module = console_scripts()[argv[0]]
        return module.replace(".", "/") + ".py", argv[1:]
    if argv[1] == "-m":
        return argv[2].replace(".", "/") + ".py", argv[3:]
    return argv[1], argv[2:]


def run_tool(script: str, args: list[str], parse: bool) -> tuple[int, str]:
    """Run ``script`` as ``__main__`` in this process (cwd: the quick start's directory); (exit code, output)."""
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                (parse_only() if parse else contextlib.nullcontext()):
            runpy.run_path(str(REPO / script), run_name="__main__")
        code = 0
    except Parsed:
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return code, out.getvalue()


def sbatch_counts(argv: list[str], script: Path) -> dict[str, str]:
    """``num_nodes``/``num_gpus`` of the allocation an ``sbatch`` command asks for (its options, else the
    script's ``#SBATCH`` lines): what deepy.py reads from the allocation, given to a dry run outside one."""
    lines = [line.split(None, 1)[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", " ".join([*lines, *argv])))
    return {"num_nodes": options.get("nodes", "1"), "num_gpus": options.get("ntasks-per-node", "1")}


def run_deepy(args: list[str]) -> tuple[int, str]:
    """``deepy.py --dry-run ARGS`` in this process: (exit code, what it printed)."""
    from megatron.app.deepy import main
    from megatron.errors import DeepyError

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(["--dry-run", *args])
        except DeepyError as err:
            print(f"deepy: {err.kind}: {err.message}")
            code = 2
    return code, out.getvalue()
