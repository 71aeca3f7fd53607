"""Before-launch checks of ``eval_tasks`` (``megatron/evaluation/config.py``), registered with every other
check (``megatron/config_rules.py``).

Training runs the tasks at every ``eval_interval`` on the model where it is (``evaluation/in_training.py``);
a mistake there used to surface at the first evaluation, after the steps before it were trained. These
checks find the ones the keys and this machine's files can show, before anything is launched:

* layouts the evaluation forwards cannot run in: ``context_parallel_size > 1`` (the key/value cache reads
  whole sequences), ``sequence_parallel`` with tensor parallelism (the cache cannot split the sequence);
* an objective whose model has no language-model head (``train_impl: rm``);
* a task entry that is neither an existing task file or directory nor a name lm-evaluation-harness knows.

Names are looked up without importing the harness (seconds) or building its index (tens of seconds): every
task, group and tag the harness indexes is named in one of its task YAML files (or in the YAML files the
config points at), so a name that occurs in none of them is certainly unknown (a byte search of ~14k small
files, a fraction of a second). A name that occurs somewhere is resolved exactly by the ranks before the first
step (:func:`megatron.evaluation.harness.load_tasks`), where a task whose data cannot be read (offline, a
dataset that needs a download) is refused too.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from megatron.config_rules import RuleContext, rule

_YAML = (".yaml", ".yml")


def _looks_like_a_path(entry: str) -> bool:
    return entry.endswith(_YAML) or os.sep in entry or entry.startswith(".")


def _yaml_files(root: Path) -> Iterable[Path]:
    if root.is_file():
        yield root
        return
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(_YAML):
                yield Path(folder) / name


@lru_cache(maxsize=4)
def _harness_task_files() -> tuple[Path, ...]:
    """The task YAML files lm-evaluation-harness indexes (empty when it is not installed)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return ()
    return tuple(_yaml_files(Path(spec.origin).parent / "tasks"))


def unknown_task_names(tasks: list[str], harness_files: Iterable[Path] | None = None) -> list[str]:
    """The entries of ``tasks`` that are bare names occurring in no task YAML file (the harness' own, and those
    of the files and directories ``tasks`` names), so no index can resolve them."""
    local = [Path(t) for t in tasks if Path(t).exists()]
    names = [t for t in tasks if not Path(t).exists() and not _looks_like_a_path(t)]
    if not names:
        return []
    left = {name: name.encode() for name in names}
    files = [*(f for p in local for f in _yaml_files(p if p.is_dir() else p.parent)),
             *(_harness_task_files() if harness_files is None else harness_files)]
    for path in files:
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for name in [n for n, raw in left.items() if raw in text]:
            del left[name]
        if not left:
            break
    return [name for name in names if name in left]


@rule
def eval_tasks_can_run(ctx: RuleContext) -> list[str]:
    """The layout, the objective and the task entries let lm-evaluation-harness run (see module doc)."""
    tasks = ctx.get("eval_tasks")
    if not tasks:
        return []
    from megatron.objective_needs import needs_of

    shown = ctx.show("eval_tasks")
    problems: list[str] = []
    if ctx.cp > 1:
        problems.append(f"{shown} with {ctx.show('context_parallel_size')}: the task evaluation reads whole "
                        "sequences with a key/value cache, which context parallelism cannot split; remove eval_tasks "
                        "and run eval.py on a checkpoint with context_parallel_size=1")
    if ctx.get("sequence_parallel") and ctx.tp > 1:
        problems.append(f"{shown} with {ctx.show('sequence_parallel')} and {ctx.show('model_parallel_size')}: the task "
                        "evaluation inside training uses a key/value cache, which cannot split the sequence; remove "
                        "eval_tasks (or sequence_parallel) and run eval.py on a checkpoint, which builds the model "
                        "without sequence parallelism (sequence_parallel=false changes no weight)")
    impl = str(ctx.get("train_impl") or "normal")
    if needs_of(impl).value_head:
        problems.append(f"{shown} with {ctx.show('train_impl')}: the model ends in a scalar value head, and the "
                        "tasks score the tokens a language model predicts; remove eval_tasks")
    missing = [t for t in tasks if _looks_like_a_path(t) and not Path(t).exists()]
    if missing:
        problems.append(f"{shown}: task file(s) {missing} not found; give existing task YAML files or directories, "
                        "or lm-evaluation-harness task names")
    # the ranks run the tasks defined by the YAML files directly in a directory entry (harness._specs)
    empty = [t for t in tasks if Path(t).is_dir() and not any(p.suffix in _YAML for p in Path(t).iterdir())]
    if empty:
        problems.append(f"{shown}: {empty} holds no task YAML files (a directory entry runs the tasks of the YAML "
                        "files in it); give the directory the task files are in, or the files themselves")
    if importlib.util.find_spec("lm_eval") is not None:  # missing: optional_packages names the package
        unknown = unknown_task_names(list(tasks))
        if unknown:
            problems.append(f"{shown}: unknown task(s) {unknown}: neither lm-evaluation-harness tasks, groups or "
                            "tags nor existing task YAML files (`python -m lm_eval ls tasks` lists the known ones)")
    return problems
