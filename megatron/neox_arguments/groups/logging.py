"""Where metrics go (metrics.jsonl, TensorBoard, W&B), how often, and which optional diagnostics
are computed. Comet and gradient-noise-scale estimation are not built yet.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from megatron.neox_arguments.groups.support import partly_supported
from megatron.neox_arguments.schema import ArgGroup, not_supported


class LoggingArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsLogging`` group."""

    use_wandb: bool | None = not_supported(None)
    """Log metrics to Weights & Biases; unset means on when wandb is installed and logged in."""

    wandb_group: str | None = not_supported(None)
    """W&B group that collects the runs of one experiment."""

    wandb_run_name: str | None = not_supported(None)
    """Display name of the run in W&B."""

    wandb_team: str | None = not_supported(None)
    """W&B entity (team or user) owning the project."""

    wandb_project: str = not_supported("neox")
    """W&B project name."""

    wandb_host: str = not_supported("https://api.wandb.ai")
    """W&B server URL, for self-hosted instances."""

    wandb_init_all_ranks: bool = not_supported(False)
    """Start a W&B run on every rank instead of rank 0 only (for per-rank system metrics)."""

    git_hash: str | None = None
    """Commit of the code that ran, recorded at launch. GPT-NeoX computes it as the field default;
    Deepy fills it in when the config is resolved, so the default here is None."""

    log_dir: str | None = None
    """Directory for text logs and metrics.jsonl."""

    tensorboard_dir: str | None = not_supported(None)
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

    log_grad_pct_zeros: bool = not_supported(False)
    """Log the share of exactly-zero gradient entries per parameter."""

    log_param_norm: bool = not_supported(False)
    """Log the global parameter norm."""

    log_grad_norm: bool = not_supported(False)
    """Log the global gradient norm, measured before clipping."""

    log_optimizer_states: bool = not_supported(False)
    """Log norms of the optimizer's moment estimates."""

    log_gradient_noise_scale: bool = not_supported(False)
    """Estimate and log the gradient noise scale (critical batch size)."""

    gradient_noise_scale_n_batches: int = not_supported(5)
    """Number of batches the gradient-noise-scale estimate accumulates."""

    gradient_noise_scale_cpu_offload: bool = not_supported(False)
    """Keep gradient-noise-scale buffers on the CPU."""

    memory_profiling: bool = not_supported(False)
    """Record a CUDA memory snapshot for offline inspection."""

    memory_profiling_path: str | None = not_supported(None)
    """Where the memory snapshot is written."""

    profile: bool = not_supported(False)
    """Run the torch profiler between profile_step_start and profile_step_stop."""

    profile_step_start: int = not_supported(10)
    """First step the profiler records."""

    profile_step_stop: int = not_supported(12)
    """Step at which the profiler stops."""
