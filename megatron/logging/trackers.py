"""Where logged rows go: metrics.jsonl, TensorBoard, Weights & Biases, Comet — several at once.

Each tracker type is a small class behind one interface (``log(row, step)``, ``finish()``), built
from a registry keyed by the config's type string (``jsonl``, ``tensorboard``, ``wandb``). The
training loop only ever calls :meth:`Trackers.log`.

- W&B: ``wandb.init`` with a run id that the checkpoint carries (``TrainState.wandb_run_id``), so a
  resumed run continues the same W&B run and its step axis (``step=iteration``). Offline mode
  (``WANDB_MODE=offline`` or ``mode: offline``) needs no network. The API key is never passed by
  Deepy: wandb reads it from WANDB_API_KEY or ~/.netrc itself, so it appears on no command line and
  in no log line of ours. With ``wandb_code_dir`` the speaking rank's run also saves that directory's
  source files and records its git commit (:func:`code_settings`); wandb itself saves the Python
  packages installed (the run file requirements.txt) with every run.
- TensorBoard: ``torch.utils.tensorboard.SummaryWriter``; a resumed run purges events at or after
  its first step, so a resume from an older checkpoint does not leave two curves.
- Comet (``use_comet``): ``comet_ml.start`` on the speaking rank, as GPT-NeoX ea7aefd8 does
  (``NeoXArgs.initialize_comet``, megatron/neox_arguments/arguments.py:182-221): output capture off, the
  resolved config logged as the experiment's parameters (nested ones flattened), then its name, tags and
  others; each row's numbers go through the call GPT-NeoX's ``tb_wandb_log`` makes
  (``__internal_api__log_metric__(name, value, framework="gpt-neox", step=iteration)``, logging.py:586), so a
  Comet dashboard shows Deepy's and GPT-NeoX's runs alike. comet_ml finds the API key, workspace defaults
  and online/offline mode itself (COMET_API_KEY, COMET_START_ONLINE=false, COMET_OFFLINE_DIRECTORY,
  ~/.comet.config); a resumed run starts a new experiment, as GPT-NeoX's does.
- metrics.jsonl: the run's own file ``<log_dir>/<run name>/metrics.jsonl`` (see ``metrics.py``); a
  resumed run drops the rows logged after its checkpoint before continuing it.

Every tracker's step axis is the iteration, which a resumed run continues from its checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron import plugins
from megatron.logging.config import CometSettings, JsonlSettings, TensorboardSettings, TrackerSettings, WandbSettings
from megatron.logging.config import TrackerBlock as TrackerBlock  # re-exported: plug-ins subclass it
from megatron.logging.metrics import MetricsWriter

class Tracker(Protocol):
    def log(self, row: Mapping[str, Any], step: int) -> None: ...

    def finish(self, failed: bool = False) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackerContext:
    """Runtime facts a tracker needs that are not config keys."""

    rank: int
    speaks: bool
    """This rank logs the training metrics (global rank 0)."""
    run_id: str | None
    """W&B run id agreed by every rank: the checkpoint's when resuming, else a new one."""
    start_step: int
    """Iteration the run starts from (0 for a fresh run)."""
    run_name: str | None = None
    """The run's name (``TrainState.run_name``): its metrics.jsonl lives in ``<log_dir>/<run_name>/``.
    None writes ``<log_dir>/metrics.jsonl`` itself (a one-off writer outside training)."""
    run_config: Mapping[str, Any] = field(default_factory=dict)
    """The resolved arguments, recorded as the run's config/hyperparameters."""


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a row except the step itself (trackers plot numbers only)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "iteration":
            continue
        if hasattr(value, "item") and callable(value.item):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class JsonlTracker:
    def __init__(self, settings: JsonlSettings, ctx: TrackerContext) -> None:
        if ctx.run_name is None:
            self.writer = MetricsWriter(settings.log_dir, enabled=ctx.speaks)
        else:
            self.writer = MetricsWriter.for_run(settings.log_dir, ctx.run_name, resume_from=ctx.start_step,
                                                enabled=ctx.speaks)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self.writer.write({"iteration": step, **row})

    def finish(self, failed: bool = False) -> None:
        self.writer.close()


class TensorboardTracker:
    def __init__(self, settings: TensorboardSettings, ctx: TrackerContext) -> None:
        # lazy: TensorBoard is optional and slow to import
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a resumed run is about to write again (resume from an older
        # checkpoint); TensorBoard otherwise shows both copies of those steps
        purge = ctx.start_step + 1 if ctx.start_step > 0 else None
        self.writer = SummaryWriter(log_dir=settings.logdir, purge_step=purge)
        if ctx.run_config and ctx.start_step == 0:
            self.writer.add_text("config", "```\n" + json.dumps(dict(ctx.run_config), indent=1, default=str) + "\n```", 0)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed run keeps every row it logged, like metrics.jsonl

    def finish(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, settings: WandbSettings, ctx: TrackerContext, log_dir: str | None) -> None:
        # lazy: wandb is optional and slow to import
        import wandb

        self.speaks = ctx.speaks
        run_id = ctx.run_id if ctx.speaks else f"{ctx.run_id}-rank{ctx.rank}"
        name = settings.name
        if not ctx.speaks and name:
            name = f"{name}-rank{ctx.rank}"
        # wandb users point WANDB_DIR at where its files go: it wins over our log_dir (passed explicitly,
        # since wandb's process-wide settings may have been read before the variable was set)
        directory = os.environ.get("WANDB_DIR") or log_dir or "."
        os.makedirs(directory, exist_ok=True)
        code, commit = code_settings(settings.code_dir if ctx.speaks else None, os.environ)
        config = {**ctx.run_config, **({"git_commit": commit} if commit else {})}
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=name,
            group=settings.group,
            tags=list(settings.tags) or None,
            notes=settings.notes,
            mode=settings.mode,
            id=run_id,
            resume="allow",  # same id: continue that run (and its step axis) when it exists
            dir=directory,
            config=config if ctx.speaks else None,
            # console="off": W&B would otherwise wrap stdout/stderr of every rank it runs on
            settings=wandb.Settings(base_url=settings.host, console="off", **code),
        )
        if code and self.run.settings.save_code:  # what wandb's code_dir setting does, less what git ignores
            assert settings.code_dir is not None
            self.run.log_code(settings.code_dir, include_fn=source_files(settings.code_dir))

    @property
    def run_id(self) -> str:
        return str(self.run.id)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if self.speaks:
            self.run.log(scalars(row), step=step)

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class CometTracker:
    def __init__(self, settings: CometSettings, ctx: TrackerContext) -> None:
        # lazy: comet_ml is optional and slow to import
        import comet_ml

        # auto_output_logging off: GPT-NeoX's reason, Comet's capture of stdout would interfere with the tee
        # of the console (arguments.py:187); comet_ml.start reads the key and the mode from the environment
        # arg-type: comet_ml documents False (no capture) among its values but annotates the parameter str
        off = comet_ml.ExperimentConfig(auto_output_logging=False)  # type: ignore[arg-type]
        self.experiment = comet_ml.start(workspace=settings.workspace, project=settings.project, experiment_config=off)
        if ctx.run_config:
            self.experiment.__internal_api__log_parameters__(dict(ctx.run_config), framework="gpt-neox",
                                                             source="manual", flatten_nested=True)
        if settings.name:
            self.experiment.set_name(settings.name)
        if settings.tags:
            self.experiment.add_tags(list(settings.tags))
        if settings.others:
            self.experiment.log_others(settings.others)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(row).items():
            self.experiment.__internal_api__log_metric__(key, value, framework="gpt-neox", step=step)

    def finish(self, failed: bool = False) -> None:
        self.experiment.end()  # offline: writes the archive


def code_settings(code_dir: str | None, environ: Mapping[str, str]) -> tuple[dict[str, Any], str | None]:
    """The ``wandb.Settings`` of a run that saves ``code_dir``'s source, and the commit recorded with it
    (Levanter's ``WandbConfig._git_settings``/``_get_git_sha``, tracker/wandb.py:245-294@9263f81e: git_root
    the directory; the commit is $GIT_COMMIT, else the HEAD of the repository whose root the directory is,
    else none).

    Levanter also sets wandb's code_dir, which makes wandb (0.31.0, wandb_run.py ``_on_start``) call
    ``log_code(code_dir)`` when its save_code setting is on; the tracker makes that call itself, to leave
    out what git ignores (:func:`source_files`). The key asks for the code, so save_code is on unless the
    user's WANDB_SAVE_CODE or WANDB_DISABLE_CODE says otherwise (online, wandb lets the account's
    code-saving setting win over all of them, wandb_init.py)."""
    if code_dir is None:
        return {}, None
    out: dict[str, Any] = {"git_root": code_dir}
    if "WANDB_SAVE_CODE" not in environ and "WANDB_DISABLE_CODE" not in environ:
        out["save_code"] = True
    commit = environ["GIT_COMMIT"] if "GIT_COMMIT" in environ else head_commit(code_dir)
    if commit:
        out["git_commit"] = commit
    return out, commit


def source_files(root: str) -> Callable[[str, str], bool]:
    """Which files of ``root`` ``log_code`` saves: those wandb's own rule takes (*.py, requirements.txt,
    Dockerfile*; wandb/util.py ``_is_py_requirements_or_dockerfile``) that git does not ignore (tracked or
    new), so a checkout's .venv (thousands of *.py) stays out; outside a git work tree, every such file
    but those of a Python environment (a directory holding pyvenv.cfg or conda-meta)."""
    def wandbs_rule(path: str) -> bool:
        name = os.path.basename(path)
        return name.endswith(".py") or name.startswith("Dockerfile") or name == "requirements.txt"

    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, timeout=60)
        listed = set(out.stdout.split("\0")) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        listed = None
    if listed is not None:
        return lambda path, top: wandbs_rule(path) and os.path.relpath(path, top) in listed

    def in_environment(path: str, top: str) -> bool:
        parts = os.path.relpath(os.path.dirname(path), top).split(os.sep)
        dirs = (os.path.join(top, *parts[:n]) for n in range(1, len(parts) + 1))
        return any(os.path.exists(os.path.join(d, m)) for d in dirs for m in ("pyvenv.cfg", "conda-meta"))

    return lambda path, top: wandbs_rule(path) and not in_environment(path, top)


def head_commit(root: str) -> str | None:
    """HEAD of the git repository whose root is ``root`` (as GitPython's ``Repo(root)`` reads it: a
    directory inside a repository is not its root), or None."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


TrackerFactory = Callable[[Any, TrackerContext, str | None], Tracker]



def _tensorboard(settings: TensorboardSettings, ctx: TrackerContext, log_dir: str | None) -> Tracker:
    return TensorboardTracker(settings, ctx)


plugins.attach("tracker", "wandb", target=WandbTracker)
plugins.attach("tracker", "tensorboard", target=_tensorboard)


def _factory(settings: TrackerSettings) -> TrackerFactory:
    """The constructor of a tracker: metrics.jsonl is built in (on whenever ``log_dir`` is set, no
    ``tracker:`` entry); every other type is a plug-in."""
    if settings.type == "jsonl":
        return lambda s, ctx, log_dir: JsonlTracker(s, ctx)
    if settings.type == "comet":  # GPT-NeoX's flat keys only, no ``tracker:`` block
        return lambda s, ctx, log_dir: CometTracker(s, ctx)
    return plugins.get("tracker", settings.type).resolve()


def runs_on(settings: TrackerSettings, ctx: TrackerContext) -> bool:
    """Trackers live on the speaking rank; W&B also on every rank with ``wandb_init_all_ranks``."""
    if ctx.speaks:
        return True
    return isinstance(settings, WandbSettings) and settings.init_all_ranks


class Trackers:
    """All trackers of this rank; ``log`` fans a row out to each."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @property
    def wandb_run_id(self) -> str | None:
        return next((t.run_id for t in self.trackers if isinstance(t, WandbTracker)), None)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(row, step)

    def finish(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.finish(failed)
        self.trackers = []


def build_trackers(settings: tuple[TrackerSettings, ...], ctx: TrackerContext, log_dir: str | None) -> Trackers:
    return Trackers([_factory(s)(s, ctx, log_dir) for s in settings if runs_on(s, ctx)])


def new_run_name(now: float | None = None) -> str:
    """``YYYYmmdd-HHMMSS-xxxx``: sorts by start time; the random tail keeps two runs started in
    the same second (and the same ``log_dir``) apart."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(2)}"


def new_wandb_run_id() -> str:
    """Eight random lowercase letters and digits, the shape of W&B's own ids (its generator moved
    between wandb releases, so none is imported)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))
