"""The logging component's own frozen config, read once from the user's keys.

``LoggingConfig.from_args(args)`` is the one place that turns the two tracker spellings (GPT-NeoX's
``use_wandb``/``wandb_*``/``tensorboard_dir`` and Levanter's ``tracker:`` block) into one tuple of
tracker settings, so the pre-launch check and the ranks agree on what will be logged where. Every
default lives in the schema (``megatron/neox_arguments/groups/logging.py``); nothing here has one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron.errors import ConfigError

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

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


TrackerSettings = WandbSettings | TensorboardSettings | JsonlSettings | PluginTrackerSettings


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


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    log_dir: str | None
    log_interval: int
    trackers: tuple[TrackerSettings, ...]
    wall_clock_breakdown: bool
    """DeepSpeed's forward/backward/allreduce/optimizer/pipeline timers, logged as timers/*."""
    peak_theoretical_tflops: float | None
    stats: StatsSettings
    profile: ProfileSettings
    deepspeed_log_level: str
    device_memory_gb: float | None = None
    """One accelerator's memory, for the memory estimate of ``--dry-run``."""

    @classmethod
    def from_args(cls, args: NeoXArgs) -> LoggingConfig:
        trackers = tracker_settings(args)
        tb_dir = next((t.logdir for t in trackers if isinstance(t, TensorboardSettings)), None)
        base = args.log_dir or "."
        trace_dir = tb_dir or os.path.join(base, "tensorboard")
        return cls(
            log_dir=args.log_dir,
            log_interval=args.log_interval,
            trackers=trackers,
            wall_clock_breakdown=bool(args.wall_clock_breakdown),
            peak_theoretical_tflops=args.peak_theoretical_tflops,
            stats=StatsSettings(
                param_norm=args.log_param_norm,
                grad_norm=args.log_grad_norm,
                grad_pct_zeros=args.log_grad_pct_zeros,
                optimizer_states=args.log_optimizer_states,
            ),
            profile=ProfileSettings(
                torch_profiler=args.profile,
                memory_snapshot=args.memory_profiling,
                start=args.profile_step_start,
                stop=args.profile_step_stop,
                trace_dir=trace_dir,
                memory_dir=args.memory_profiling_path or os.path.join(tb_dir or base, "memory"),
            ),
            deepspeed_log_level=args.deepspeed_log_level,
            device_memory_gb=args.device_memory_gb,
        )

    def tracker(self, kind: str) -> TrackerSettings | None:
        return next((t for t in self.trackers if t.type == kind), None)


def tracker_settings(args: NeoXArgs) -> tuple[TrackerSettings, ...]:
    """Trackers asked for by either spelling; one tracker asked for twice is a config error (which
    settings would win is not obvious, so the user picks)."""
    blocks = args.tracker if isinstance(args.tracker, list) else [args.tracker] if args.tracker else []
    out: list[TrackerSettings] = []
    if args.log_dir:
        out.append(JsonlSettings(log_dir=args.log_dir))
    kinds = [block.type for block in blocks]
    for kind in sorted({k for k in kinds if kinds.count(k) > 1}):
        raise ConfigError(f"tracker lists type {kind!r} {kinds.count(kind)} times: give each tracker type once")
    for block in blocks:
        if block.type == "wandb":
            if args.use_wandb:
                raise ConfigError(
                    "W&B is configured twice: use_wandb=true and tracker {type: wandb}; keep one spelling "
                    "(the wandb_* keys fill in what the tracker block leaves unset)"
                )
            out.append(WandbSettings(
                project=block.project or args.wandb_project,
                entity=block.entity or args.wandb_team,
                name=block.name or args.wandb_run_name,
                group=block.group or args.wandb_group,
                tags=tuple(block.tags),
                notes=block.notes,
                mode=block.mode,
                host=block.host or args.wandb_host,
                init_all_ranks=args.wandb_init_all_ranks,
                source="tracker",
                run_id=block.id,
            ))
        elif block.type == "tensorboard":
            if args.tensorboard_dir and block.logdir and block.logdir != args.tensorboard_dir:
                raise ConfigError(
                    f"TensorBoard is configured twice with different directories: tensorboard_dir="
                    f"{args.tensorboard_dir!r} and tracker {{type: tensorboard, logdir: {block.logdir!r}}}; keep one"
                )
            logdir = block.logdir or args.tensorboard_dir or os.path.join(args.log_dir or ".", "tensorboard")
            out.append(TensorboardSettings(logdir=logdir, source="tracker"))
        else:
            out.append(PluginTrackerSettings(type=block.type, block=block))
    if args.use_wandb and not any(t.type == "wandb" for t in out):
        out.append(WandbSettings(
            project=args.wandb_project, entity=args.wandb_team, name=args.wandb_run_name,
            group=args.wandb_group, tags=(), notes=None, mode=None, host=args.wandb_host,
            init_all_ranks=args.wandb_init_all_ranks, source="use_wandb",
        ))  # fmt: skip
    if args.tensorboard_dir and not any(t.type == "tensorboard" for t in out):
        out.append(TensorboardSettings(logdir=args.tensorboard_dir, source="tensorboard_dir"))
    return tuple(out)
