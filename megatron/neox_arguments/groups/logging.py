"""Where metrics go (metrics.jsonl, TensorBoard, W&B), how often, and which optional diagnostics
are computed. Comet and gradient-noise-scale estimation are not built yet.

Trackers come in two spellings: GPT-NeoX's flat keys (``use_wandb``, ``wandb_project``,
``tensorboard_dir``) and Levanter's ``tracker:`` block (``{type: wandb, project: ...}`` or a list of
them), validated as a union discriminated by ``type``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from megatron import plugins
from megatron.config_schema import ArgGroup, not_supported


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
    (``megatron/logging/trackers.py``)."""

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
