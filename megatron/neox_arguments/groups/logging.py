"""Where metrics go (metrics.jsonl, TensorBoard, W&B), how often, and which optional diagnostics
are computed. Comet and gradient-noise-scale estimation are not built yet.

Trackers come in two spellings: GPT-NeoX's flat keys (``use_wandb``, ``wandb_project``,
``tensorboard_dir``) and Levanter's ``tracker:`` block (``{type: wandb, project: ...}`` or a list of
them), validated as a union discriminated by ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megatron.neox_arguments.schema import ArgGroup, not_supported


class _TrackerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class WandbTrackerArgs(_TrackerArgs):
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
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$")
    """W&B run id of a new run (Levanter's trainer.id); a resumed run keeps its checkpoint's id."""


class TensorboardTrackerArgs(_TrackerArgs):
    """``tracker: {type: tensorboard, logdir: ...}``."""

    type: Literal["tensorboard"] = "tensorboard"
    logdir: str | None = None
    """Directory of the event files; unset means tensorboard_dir, else <log_dir>/tensorboard."""


TrackerArgs = Annotated[WandbTrackerArgs | TensorboardTrackerArgs, Field(discriminator="type")]


class LoggingArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsLogging`` group."""

    use_wandb: bool | None = None
    """Log metrics to Weights & Biases (WANDB_MODE=offline works without a network; the API key is
    read by wandb from WANDB_API_KEY or ~/.netrc, never from the config); unset means off (GPT-NeoX
    turns it on when wandb is logged in; Deepy uploads only when asked)."""

    tracker: TrackerArgs | list[TrackerArgs] | None = None
    """Levanter-style trackers: {type: wandb, project: ...}, {type: tensorboard, logdir: ...} or a
    list of them, on top of metrics.jsonl; same effect as the GPT-NeoX keys (give one spelling)."""

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

    git_hash: str | None = None
    """Commit of the code that ran, recorded at launch. GPT-NeoX computes it as the field default;
    Deepy fills it in when the config is resolved, so the default here is None."""

    log_dir: str | None = None
    """Directory for text logs and metrics.jsonl."""

    deepspeed_log_level: Literal["debug", "info", "warning", "error", "critical"] = "warning"
    """Level of DeepSpeed's own log lines (runner, launcher, engine); its INFO lines are hidden by
    default so Deepy's lines stand out, and deepy.py --debug shows them (info)."""

    device_memory_gb: float | None = Field(None, gt=0)
    """Memory of one accelerator in GiB, for the memory estimate of deepy.py --dry-run; unset means
    detected when deepy launches on local GPUs (no warning otherwise)."""

    tensorboard_dir: str | None = None
    """Write TensorBoard event files here; unset disables TensorBoard."""

    use_comet: bool | None = not_supported(None)
    """Log metrics to Comet ML."""

    comet_workspace: str | None = not_supported(None)
    """Comet workspace name."""

    comet_project: str | None = not_supported(None)
    """Comet project name."""

    comet_experiment_name: str | None = not_supported(None)
    """Comet experiment name."""

    comet_tags: list[str] | None = not_supported(None)
    """Tags attached to the Comet experiment."""

    comet_others: dict[str, Any] | None = not_supported(None)
    """Extra keyword arguments passed to the Comet experiment."""

    comet_experiment: Any = not_supported(None)
    """The live Comet experiment object; set at runtime only."""

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

    log_gradient_noise_scale: bool = not_supported(False)
    """Estimate and log the gradient noise scale (critical batch size)."""

    gradient_noise_scale_n_batches: int = not_supported(5)
    """Number of batches the gradient-noise-scale estimate accumulates."""

    gradient_noise_scale_cpu_offload: bool = not_supported(False)
    """Keep gradient-noise-scale buffers on the CPU."""

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
