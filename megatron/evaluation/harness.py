"""Running lm-evaluation-harness tasks on a `DeepyLM` and writing what came out.

Tasks are names known to the harness or paths of task YAML files (or of directories holding them):
local files are indexed on their own, and the harness' index of its ~15k built-in tasks (tens of
seconds of CPU) is built only when a name is not found among them. A task reads its data through
Hugging Face `datasets` exactly as the harness does; a task defined over local files
(`dataset_path: json` with `data_files`) needs no network.

Rank 0 writes
* `<results_prefix>_eval_results.json` (or `<log_dir>/eval_results.json` without a prefix): the
  harness' results, versions, task configs and sample counts, plus the checkpoint evaluated;
* `<same base>_eval_samples_<task>.jsonl`: every request of each task with the model's answers;
* one row in the metrics file of the training run that wrote the checkpoint,
  `<log_dir>/<run name>/metrics.jsonl` (the name is in the checkpoint's `train_state`; `log_dir` may hold
  newer runs, which the `<log_dir>/metrics.jsonl` link follows): `lm_eval/<task>/<metric>` (`/<filter>` when
  not "none") at the checkpoint's iteration. A checkpoint without a run name (written before runs had
  one) gets the row in `<log_dir>/metrics.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from lm_eval.utils import handle_non_serializable

from megatron.atomic_files import atomic_path
from megatron.errors import ConfigError
from megatron.evaluation.config import EvalRun
from megatron.evaluation.lm_eval_adapter import DeepyLM
from megatron.logging.log import get_logger
from megatron.logging.metrics import METRICS_FILE, MetricsWriter, point_newest_run

STDERR_BOOTSTRAP_ITERS = 1000
"""Resamples for the harness' bootstrap standard errors (its command line defaults to 100k)."""


def _task_manager(tasks: tuple[str, ...]) -> Any:
    # lazy: lm-eval is optional (eval_tasks) and slow to import
    from lm_eval.tasks import TaskManager

    local = [Path(t) for t in tasks if Path(t).exists()]
    dirs = sorted({str(p if p.is_dir() else p.parent) for p in local})
    manager = TaskManager(include_path=dirs or None, include_defaults=False)
    names = [t for t in tasks if not Path(t).exists()]
    if any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=dirs or None, include_defaults=True)
        unknown = [name for name in names if name not in manager.all_tasks]
        if unknown:
            raise ConfigError(f"eval_tasks: unknown task(s) {unknown}: neither lm-evaluation-harness tasks nor "
                              "existing task YAML files (`python -m lm_eval ls tasks` lists the known ones)")
    return manager


def _specs(tasks: tuple[str, ...], manager: Any) -> list[str]:
    """Directories expand to the tasks defined in them; files and names pass as they are."""
    specs: list[str] = []
    for task in tasks:
        path = Path(task)
        if path.is_dir():
            found = [name for name, entry in manager.task_index.items()
                     if entry.yaml_path is not None and Path(entry.yaml_path).resolve().parent == path.resolve()]
            if not found:
                raise ConfigError(f"eval_tasks: {task} holds no task YAML files")
            specs.extend(sorted(found))
        else:
            specs.append(task)
    return specs


def load_tasks(tasks: list[str] | tuple[str, ...]) -> None:
    """Resolve every task and read its documents, as the first evaluation will; a task that cannot be
    loaded (an unknown name, a dataset that needs a download while offline, a broken task file) is a
    ConfigError naming it. Training calls this on every rank before its first step."""
    # lazy: lm-eval is optional (eval_tasks) and slow to import
    from lm_eval.tasks import get_task_dict

    manager = _task_manager(tuple(tasks))
    for spec in _specs(tuple(tasks), manager):
        try:
            get_task_dict([spec], manager)
        except Exception as err:  # noqa: BLE001 - datasets, hub and jinja each raise their own types
            offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "") not in ("", "0")]
            raise ConfigError(
                f"eval_tasks: task {spec!r} cannot be loaded ({type(err).__name__}: {str(err)[:300]}). "
                "A task reads its documents through Hugging Face datasets"
                + (f"; with {', '.join(offline)} set they must already be in its cache" if offline else "")
                + ": download them first (or point the task at local files: dataset_path: json with data_files, as "
                "configs/lm_eval/python_builtins.yaml does), or remove the task") from None


def evaluate(lm: DeepyLM, config: EvalRun) -> dict[str, Any]:
    """Run every task on every rank (the adapter splits the model work); the harness' results."""
    # lazy: lm-eval is optional (eval_tasks) and slow to import
    from lm_eval import simple_evaluate

    if lm.replica.dp_rank or lm.replica.tp_rank or lm.replica.pp_rank:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # every rank runs the harness; one speaks
    # the harness bootstraps standard errors in a multiprocessing pool: a fork of a rank that
    # holds a process group (gloo/NCCL threads) is not safe, so it runs them in-process
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    manager = _task_manager(tuple(config.evaluation.eval_tasks or ()))
    results = simple_evaluate(
        model=lm,
        tasks=_specs(tuple(config.evaluation.eval_tasks or ()), manager),
        task_manager=manager,
        limit=config.evaluation.eval_tasks_limit,
        bootstrap_iters=STDERR_BOOTSTRAP_ITERS,
        log_samples=True,
        random_seed=config.model.seed,
        numpy_random_seed=config.model.seed,
        torch_random_seed=config.model.seed,
        fewshot_random_seed=config.model.seed,
    )
    if results is None:  # the harness returns results on local rank 0 only
        return {}
    return results


def results_base(config: EvalRun) -> str:
    if config.evaluation.eval_results_prefix:
        return f"{config.evaluation.eval_results_prefix}_"
    return os.path.join(config.logging.log_dir or ".", "")


def metric_rows(results: dict[str, Any]) -> dict[str, float]:
    """`lm_eval/<task>/<metric>[/<filter>]` -> value, for every numeric metric (stderrs included)."""
    row: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            name = f"lm_eval/{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")
            row[name] = float(value)
    return row


def metrics_dir(log_dir: str | None, run_name: str | None) -> Path | None:
    """Where the metrics row goes: the directory of run ``run_name``'s metrics.jsonl under ``log_dir``."""
    if log_dir is None:
        return None
    return Path(log_dir) / run_name if run_name else Path(log_dir)


def write_results(results: dict[str, Any], config: EvalRun, *, checkpoint: str | None, step: int,
                  run_name: str | None = None) -> Path:
    """The files described in the module docstring; call on rank 0. ``run_name``: the training run that
    wrote the checkpoint (its ``TrainState.run_name``)."""
    base = results_base(config)
    samples = results.pop("samples", {}) or {}
    results["deepy"] = {"checkpoint": checkpoint, "iteration": step,
                        "tasks": list(config.evaluation.eval_tasks or []),
                        "run_name": run_name}
    path = Path(f"{base}eval_results.json")
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable), encoding="utf-8")
    for task, rows in samples.items():
        with atomic_path(f"{base}eval_samples_{task}.jsonl") as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                for sample in rows:
                    f.write(json.dumps(sample, default=handle_non_serializable) + "\n")
    log_dir = config.logging.log_dir
    target = metrics_dir(log_dir, run_name)
    with MetricsWriter(target) as writer:
        writer.write({"iteration": step, **metric_rows(results)})
    if run_name and log_dir and not os.path.lexists(Path(log_dir) / METRICS_FILE):
        point_newest_run(Path(log_dir), run_name)  # a log_dir of its own: the link finds the row
    log = get_logger()
    for name, value in metric_rows(results).items():
        if "_stderr" not in name:
            log.info("%s = %.6g", name, value)
    log.info("wrote %s", path)
    return path
