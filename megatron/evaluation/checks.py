"""Before-launch checks of ``eval_tasks`` (``megatron/evaluation/config.py``), registered with every other
check (``megatron/config_rules.py``).

Training runs the tasks at every ``eval_interval`` on the model where it is (``evaluation/in_training.py``);
a mistake there used to surface at the first evaluation, after the steps before it were trained. These
checks find the ones the keys and this machine's files can show, before anything is launched:

* layouts the evaluation forwards cannot run in: ``context_parallel_size > 1`` (the key/value cache reads
  whole sequences), ``sequence_parallel`` with tensor parallelism (the cache cannot split the sequence);
* an objective whose model has no language-model head (``train_impl: rm``);
* a task entry that is neither an existing task file or directory nor a name lm-evaluation-harness knows;
* for eval.py and training, a task whose documents this machine cannot read: a local data file that does not
  exist, or a Hugging Face Hub dataset that is not in the ``datasets`` cache while nothing can be downloaded
  (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` set, or the Hub unreachable): without this, both ranks retried the
  download for minutes and ended in a traceback. With the Hub reachable the download is said before launch, as
  a warning. How a task's data are found: ``megatron/evaluation/task_data.py``.

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
from pathlib import Path

from megatron.config_rules import RuleContext, rule
from megatron.evaluation.task_data import (
    EXAMPLE_TASK,
    datasets_cache,
    file_bytes,
    harness_task_files,
    hub_unreachable,
    offline_switch,
    task_sources,
    unreadable,
    yaml_files,
)
from megatron.objective_needs import needs_of

_YAML = (".yaml", ".yml")


def _looks_like_a_path(entry: str) -> bool:
    return entry.endswith(_YAML) or os.sep in entry or entry.startswith(".")


def unknown_task_names(tasks: list[str], harness_files: Iterable[Path] | None = None) -> list[str]:
    """The entries of ``tasks`` that are bare names occurring in no task YAML file (the harness' own, and those
    of the files and directories ``tasks`` names), so no index can resolve them."""
    local = [Path(t) for t in tasks if Path(t).exists()]
    names = [t for t in tasks if not Path(t).exists() and not _looks_like_a_path(t)]
    if not names:
        return []
    left = {name: name.encode() for name in names}
    files = [*(f for p in local for f in yaml_files(p if p.is_dir() else p.parent)),
             *(harness_task_files() if harness_files is None else harness_files)]
    for path in files:
        text = file_bytes(path)
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
    runs_tasks = ctx.trains or os.path.basename(ctx.entry_point or "") == "eval.py"
    if not problems and runs_tasks and importlib.util.find_spec("lm_eval") is not None:
        problems.extend(data_problems(shown, list(tasks), ctx.warnings))
    return problems


def _reads(tasks: list[str], dataset: str, most: int = 2) -> str:
    """``task 'a' reads 'org/x'``, ``tasks 'a', 'b' and 3 more read 'org/x'``."""
    unique = list(dict.fromkeys(tasks))
    listed = ", ".join(repr(t) for t in unique[:most])
    listed += f" and {len(unique) - most} more" if len(unique) > most else ""
    return f"task {listed} reads {dataset!r}" if len(unique) == 1 else f"tasks {listed} read {dataset!r}"


def data_problems(shown: str, tasks: list[str], warnings: list[str]) -> list[str]:
    """The tasks whose documents cannot be read here (one message per kind); a download the run will make is
    added to ``warnings``."""
    sources = task_sources(tasks)
    if not sources:
        return []
    gaps = [gap for source in sources if (gap := unreadable(source)) is not None]
    problems = []
    missing = [gap for gap in gaps if gap.missing]
    if missing:
        files = "; ".join(f"task {gap.task!r} reads {list(gap.missing)}" for gap in missing)
        problems.append(f"{shown}: {files}, which do not exist (data_files and dataset_path are read relative to the "
                        f"directory the run starts in, {os.getcwd()})")
    remote = [gap for gap in gaps if gap.hub]
    if remote:
        by_dataset: dict[str, list[str]] = {}
        for gap in remote:
            by_dataset.setdefault(str(gap.hub), []).append(gap.task)
        reads = "; ".join(_reads(tasks_of, hub) for hub, tasks_of in by_dataset.items())
        what = f"{reads} from the Hugging Face Hub, not in this machine's datasets cache ({datasets_cache()})"
        local = (f"a task YAML over local files (dataset_path: json with dataset_kwargs.data_files, as "
                 f"{EXAMPLE_TASK}; docs/generation.md)")
        offline = offline_switch()
        why = f"{offline} is set" if offline else hub_unreachable()
        if why:
            problems.append(f"{shown}: {what}, and nothing can be downloaded now ({why}): run once where the Hub "
                            f"can be reached (or copy that cache here), or evaluate {local} instead")
        else:
            warnings.append(f"{shown}: {what}: the ranks download it at the first evaluation; without a network, "
                            f"evaluate {local} instead")
    return problems
