"""Where metrics go (metrics.jsonl, TensorBoard, W&B, Comet), how often, and which optional diagnostics
are computed (statistics, the gradient noise scale, the profiler).

Trackers come in two spellings: GPT-NeoX's flat keys (``use_wandb``, ``wandb_project``,
``tensorboard_dir``) and Levanter's ``tracker:`` block (``{type: wandb, project: ...}`` or a list of
them), each entry validated by the model its tracker plug-in declares (``megatron/plugins.py``): Deepy's
own are declared here, by name and ``tracker:`` block, and ``trackers.py`` attaches the trackers.

Declared here, beside the logging component that reads them; the one argument object (``NeoXArgs``)
is composed of :class:`LoggingArgs`, and the trainer hands the monitor that object (typed as this
class). :meth:`LoggingArgs.tracker_settings` is the one place that turns the two spellings into one
tuple of tracker settings, so the pre-launch check and the ranks agree on what will be logged where.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from megatron import plugins
from megatron.config_schema import ArgGroup, obsolete
from megatron.errors import ConfigError

WandbMode = Literal["online", "offline", "disabled"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbSettings:
    """One W&B run per training run (rank 0; every rank with ``init_all_ranks``)."""

    project: str
    entity: str | None
    name: str | None
    group: str | None
    tags: tuple[str, ...]
    notes: str | None
    mode: WandbMode | None
    """None: wandb decides (WANDB_MODE from the environment, else online)."""
    host: str
    init_all_ranks: bool
    source: str
    """Which keys asked for it (``use_wandb`` or ``tracker``), for messages."""
    run_id: str | None = None
    """The id a new run takes (``tracker: {id: ...}``); None: a fresh one. A resumed run keeps its own."""
    code_dir: str | None = None
    """``wandb_code_dir``: the directory whose source files the run saves (a ``code`` artifact) and whose
    git commit it records; None saves none."""

    type: Literal["wandb"] = "wandb"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorboardSettings:
    logdir: str
    source: str
    type: Literal["tensorboard"] = "tensorboard"


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlSettings:
    """``<log_dir>/metrics.jsonl``, always on when ``log_dir`` is set."""

    log_dir: str
    type: Literal["jsonl"] = "jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class PluginTrackerSettings:
    """A plug-in tracker's ``tracker:`` entry, as the block model its plug-in declares validated it."""

    type: str
    block: Any
    source: str = "tracker"


@dataclass(frozen=True, kw_only=True, slots=True)
class CometSettings:
    """One Comet experiment per launch, on the speaking rank (GPT-NeoX ea7aefd8,
    ``NeoXArgs.initialize_comet``: rank 0, a new experiment each launch)."""

    workspace: str | None
    project: str | None
    name: str | None
    tags: tuple[str, ...]
    others: dict[str, Any]
    source: str = "use_comet"
    type: Literal["comet"] = "comet"


TrackerSettings = WandbSettings | TensorboardSettings | JsonlSettings | CometSettings | PluginTrackerSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsSettings:
    """Optional parameter/gradient/optimizer statistics computed at log steps."""

    param_norm: bool
    grad_norm: bool
    grad_pct_zeros: bool
    optimizer_states: bool

    @property
    def any(self) -> bool:
        return self.param_norm or self.grad_norm or self.grad_pct_zeros or self.optimizer_states

    @property
    def needs_grads(self) -> bool:
        return self.grad_norm or self.grad_pct_zeros


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSettings:
    """torch.profiler and CUDA memory history over steps ``[start, stop]``."""

    torch_profiler: bool
    memory_snapshot: bool
    start: int
    stop: int
    trace_dir: str
    memory_dir: str

    @property
    def any(self) -> bool:
        return self.torch_profiler or self.memory_snapshot


# ---- the ``tracker:`` entries of Deepy's own trackers (a plug-in tracker declares its own) ----------
class TrackerBlock(BaseModel):
    """Base of a ``tracker:`` entry: its ``type`` and the tracker's own fields, nothing else."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class WandbTrackerArgs(TrackerBlock):
    """``tracker: {type: wandb, ...}`` (Levanter's spelling of the W&B keys)."""

    type: Literal["wandb"] = "wandb"
    project: str | None = None
    """W&B project; unset means wandb_project."""
    entity: str | None = None
    """W&B entity (team or user); unset means wandb_team."""
    name: str | None = None
    """Display name of the run; unset means wandb_run_name."""
    group: str | None = None
    """W&B group; unset means wandb_group."""
    tags: list[str] = Field(default_factory=list)
    """Tags attached to the run."""
    notes: str | None = None
    """Free-text notes attached to the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; unset means WANDB_MODE from the environment, else online."""
    host: str | None = None
    """W&B server URL; unset means wandb_host."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
    """W&B run id of a new run (Levanter's trainer.id); a resumed run keeps its checkpoint's id. Letters,
    digits, _, - and . (not first: the id also names a checkpoint directory; wandb reserves :;,#?/')."""


class TensorboardTrackerArgs(TrackerBlock):
    """``tracker: {type: tensorboard, logdir: ...}``."""

    type: Literal["tensorboard"] = "tensorboard"
    logdir: str | None = None
    """Directory of the event files; unset means tensorboard_dir, else <log_dir>/tensorboard."""


# Deepy's trackers by name and block; megatron/logging/trackers.py attaches the trackers themselves
plugins.declare("tracker", "wandb", module=__name__, block=WandbTrackerArgs)
plugins.declare("tracker", "tensorboard", module=__name__, block=TensorboardTrackerArgs)
plugins.builtins_declared("tracker")


def tracker_block(entry: Any) -> BaseModel:
    """One ``tracker:`` entry validated by the model its ``type``'s plug-in declares."""
    if isinstance(entry, BaseModel):
        return entry
    if not isinstance(entry, dict) or "type" not in entry:
        raise ValueError(f"a tracker entry is a mapping with a type ({', '.join(plugins.names('tracker'))}), "
                         f"got {entry!r}")
    plugins.validate_name("tracker", entry["type"])
    block = plugins.get("tracker", entry["type"]).block
    assert block is not None, f"tracker plug-in {entry['type']!r} declares no block"
    return block.model_validate(entry)


class LoggingArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsLogging`` group."""

    use_wandb: bool | None = None
    """Log metrics to Weights & Biases (WANDB_MODE=offline works without a network; the API key is
    read by wandb from WANDB_API_KEY or ~/.netrc, never from the config); unset means off (GPT-NeoX
    turns it on when wandb is logged in; Deepy uploads only when asked)."""

    tracker: Any = None
    """Levanter-style trackers: {type: wandb, project: ...}, {type: tensorboard, logdir: ...} or a
    list of them, on top of metrics.jsonl; same effect as the GPT-NeoX keys (give one spelling).
    ``type`` is a registered tracker plug-in; each validates its own entry
    (``megatron/logging/config.py``)."""

    @field_validator("tracker", mode="before")
    @classmethod
    def _registered_trackers(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, list):
            return [tracker_block(entry) for entry in value]
        return tracker_block(value)

    wandb_group: str | None = None
    """W&B group that collects the runs of one experiment."""

    wandb_run_name: str | None = None
    """Display name of the run in W&B."""

    wandb_team: str | None = None
    """W&B entity (team or user) owning the project."""

    wandb_project: str = "neox"
    """W&B project name."""

    wandb_host: str = "https://api.wandb.ai"
    """W&B server URL, for self-hosted instances."""

    wandb_init_all_ranks: bool = False
    """Start a W&B run on every rank instead of rank 0 only (for per-rank system metrics)."""

    wandb_code_dir: str | None = None
    """The directory whose source files W&B saves with the run (its *.py, requirements.txt and
    Dockerfile* that git does not ignore, as a 'code' artifact) and whose git commit it records
    (git_commit in the run's config: $GIT_COMMIT, else the HEAD of the repository the directory is the
    root of); made absolute before launch, and it must be a directory. Null saves none. W&B's own
    switches still apply: WANDB_SAVE_CODE/WANDB_DISABLE_CODE, and online the account's code-saving
    setting (Levanter's tracker.save_code)."""

    git_hash: str | None = None
    """Commit of the code that ran, recorded at launch. GPT-NeoX computes it as the field default;
    Deepy fills it in when the config is resolved, so the default here is None."""

    log_dir: str | None = None
    """Directory for text logs and metrics.jsonl."""

    deepspeed_log_level: Literal["debug", "info", "warning", "error", "critical"] = "warning"
    """Level of DeepSpeed's own log lines (runner, launcher, engine); its INFO lines are hidden by
    default so Deepy's lines stand out, and deepy.py --debug shows them (info)."""

    device_memory_gb: float | None = Field(None, gt=0)
    """Memory of one accelerator in GiB, for the memory estimate before launch (deepy.py refuses a run
    whose estimate exceeds it); unset means detected when deepy launches on local GPUs (not checked
    otherwise)."""

    allow_memory_overcommit: bool = False
    """Launch even when the memory estimate exceeds what the ranks of a node have (device_memory_gb or
    the local GPU's memory; without a GPU, this machine's memory shared by its CPU ranks), which deepy.py
    otherwise refuses before launch: for users who know the estimate is too high for their run."""

    tensorboard_dir: str | None = None
    """Write TensorBoard event files here; unset disables TensorBoard."""

    use_comet: bool | None = None
    """Log metrics to Comet (comet_ml) from rank 0, under the same names as the other trackers, each at
    its iteration (step); the experiment's parameters are the resolved config. A new experiment each
    launch. comet_ml reads the API key (COMET_API_KEY or ~/.comet.config), never the config; with
    COMET_START_ONLINE=false it writes an offline archive (a zip in COMET_OFFLINE_DIRECTORY, else
    ./.cometml-runs) for ``comet upload``. Unset means off."""

    comet_workspace: str | None = None
    """Comet workspace of the experiment; unset means the user's default workspace."""

    comet_project: str | None = None
    """Comet project of the experiment; unset means Comet's Uncategorized Experiments."""

    comet_experiment_name: str | None = None
    """Display name of the Comet experiment; unset means a random name."""

    comet_tags: list[str] | None = None
    """Tags attached to the Comet experiment."""

    comet_others: dict[str, Any] | None = None
    """Metadata logged with the Comet experiment (comet_ml's ``log_others``: its Other tab), as in
    GPT-NeoX; not comet_ml settings."""

    comet_experiment: Any = obsolete(
        None, "it is GPT-NeoX's slot for the experiment object its initialize_comet creates at start "
        "(megatron/neox_arguments/arguments.py:188 at GPT-NeoX ea7aefd8), never a config value: Deepy creates the "
        "experiment itself; remove comet_experiment and use use_comet (with comet_workspace and comet_project)")
    """GPT-NeoX's runtime slot for the live Comet experiment; not a setting."""

    peak_theoretical_tflops: float | None = Field(None, gt=0)
    """Peak dense TFLOP/s of one accelerator, used to report MFU; unset means looked up from the
    device name."""

    log_interval: int = Field(100, ge=1)
    """Log training metrics every this many steps."""

    log_grad_pct_zeros: bool = False
    """Log the share of exactly-zero gradient entries, per parameter (grad_pct_zeros/<name>) and
    overall, at every log step."""

    log_param_norm: bool = False
    """Log the global parameter norm (train/param_norm) and each parameter's norm
    (param_norm/<name>) at every log step."""

    log_grad_norm: bool = False
    """Log each parameter's gradient norm (grad_norm/<name>) at every log step, as the optimizer
    receives it; the global norm before clipping is always logged as train/grad_norm."""

    log_optimizer_states: bool = False
    """Log norms of the optimizer's moment estimates per parameter (optimizer_state/<name>/exp_avg,
    .../exp_avg_sq) and overall."""

    log_gradient_noise_scale: bool = False
    """Estimate the gradient noise scale B_simple = tr(Sigma)/|G|^2 (McCandlish et al. 2018, the critical
    batch size) as GPT-NeoX's GradientNoiseScale does, and log it as train/noise_scale at log steps: every
    step's gradient (as the optimizer receives it: averaged over data parallelism, before clipping, loss
    scale removed) is added to a buffer; every gradient_noise_scale_n_batches steps the last step's gradient
    (small batch: train_batch_size) and the buffer's mean (large batch: n_batches x train_batch_size) give
    |G|^2 and tr(Sigma), each smoothed by a bias-corrected EMA (beta 0.99)."""

    gradient_noise_scale_n_batches: int = Field(5, ge=2)
    """Steps whose gradients make the large batch of the gradient noise scale (at least 2: the large
    batch must differ from the small one)."""

    gradient_noise_scale_cpu_offload: bool = False
    """Keep the gradient noise scale's buffer (a copy of the whole gradient) in host memory instead of
    the accelerator's."""

    memory_profiling: bool = False
    """Record CUDA allocator history from profile_step_start and dump a memory snapshot (a pickle
    for pytorch.org/memory_viz) at profile_step_stop; GPU only, refused before launch on CPU."""

    memory_profiling_path: str | None = None
    """Directory of the memory snapshots; unset means <tensorboard dir or log_dir>/memory."""

    profile: bool = False
    """Run torch.profiler from profile_step_start to profile_step_stop and write its traces into the
    TensorBoard directory (tensorboard_dir, else <log_dir>/tensorboard)."""

    profile_step_start: int = Field(10, ge=0)
    """First step the profiler (and memory_profiling) records."""

    profile_step_stop: int = Field(12, ge=0)
    """Step after which the profiler (and memory_profiling) stops; must exceed profile_step_start."""

    def tracker_settings(self) -> tuple[TrackerSettings, ...]:
        """Trackers asked for by either spelling; one tracker asked for twice is a config error (which
        settings would win is not obvious, so the user picks)."""
        tracker = self.tracker
        blocks = tracker if isinstance(tracker, list) else [tracker] if tracker else []
        out: list[TrackerSettings] = []
        if self.log_dir:
            out.append(JsonlSettings(log_dir=self.log_dir))
        kinds = [block.type for block in blocks]
        for kind in sorted({k for k in kinds if kinds.count(k) > 1}):
            raise ConfigError(f"tracker lists type {kind!r} {kinds.count(kind)} times: give each tracker type once")
        for block in blocks:
            if block.type == "wandb":
                if self.use_wandb:
                    raise ConfigError(
                        "W&B is configured twice: use_wandb=true and tracker {type: wandb}; keep one spelling "
                        "(the wandb_* keys fill in what the tracker block leaves unset)"
                    )
                out.append(WandbSettings(
                    project=block.project or self.wandb_project,
                    entity=block.entity or self.wandb_team,
                    name=block.name or self.wandb_run_name,
                    group=block.group or self.wandb_group,
                    tags=tuple(block.tags),
                    notes=block.notes,
                    mode=block.mode,
                    host=block.host or self.wandb_host,
                    init_all_ranks=self.wandb_init_all_ranks,
                    source="tracker",
                    run_id=block.id,
                    code_dir=self.wandb_code_dir,
                ))
            elif block.type == "tensorboard":
                if self.tensorboard_dir and block.logdir and block.logdir != self.tensorboard_dir:
                    raise ConfigError(
                        f"TensorBoard is configured twice with different directories: tensorboard_dir="
                        f"{self.tensorboard_dir!r} and tracker {{type: tensorboard, logdir: {block.logdir!r}}}; "
                        "keep one"
                    )
                logdir = block.logdir or self.tensorboard_dir or os.path.join(self.log_dir or ".", "tensorboard")
                out.append(TensorboardSettings(logdir=logdir, source="tracker"))
            else:
                out.append(PluginTrackerSettings(type=block.type, block=block))
        if self.use_wandb and not any(t.type == "wandb" for t in out):
            out.append(WandbSettings(
                project=self.wandb_project, entity=self.wandb_team, name=self.wandb_run_name,
                group=self.wandb_group, tags=(), notes=None, mode=None, host=self.wandb_host,
                init_all_ranks=self.wandb_init_all_ranks, source="use_wandb", code_dir=self.wandb_code_dir,
            ))  # fmt: skip
        if self.tensorboard_dir and not any(t.type == "tensorboard" for t in out):
            out.append(TensorboardSettings(logdir=self.tensorboard_dir, source="tensorboard_dir"))
        if self.use_comet:
            out.append(CometSettings(workspace=self.comet_workspace, project=self.comet_project,
                                     name=self.comet_experiment_name, tags=tuple(self.comet_tags or ()),
                                     others=dict(self.comet_others or {})))
        return tuple(out)

    @property
    def stats_settings(self) -> StatsSettings:
        """The optional statistics the log steps compute (``log_param_norm``, ``log_grad_norm``, ...)."""
        return StatsSettings(
            param_norm=self.log_param_norm,
            grad_norm=self.log_grad_norm,
            grad_pct_zeros=self.log_grad_pct_zeros,
            optimizer_states=self.log_optimizer_states,
        )

    def profile_settings(self) -> ProfileSettings:
        """The profiler's steps and where its traces and memory snapshots go: the TensorBoard directory
        (either spelling), else ``<log_dir>/tensorboard``; snapshots in ``memory_profiling_path``, else
        ``memory`` beside the traces."""
        tb_dir = next((t.logdir for t in self.tracker_settings() if isinstance(t, TensorboardSettings)), None)
        base = self.log_dir or "."
        return ProfileSettings(
            torch_profiler=self.profile,
            memory_snapshot=self.memory_profiling,
            start=self.profile_step_start,
            stop=self.profile_step_stop,
            trace_dir=tb_dir or os.path.join(base, "tensorboard"),
            memory_dir=self.memory_profiling_path or os.path.join(tb_dir or base, "memory"),
        )
