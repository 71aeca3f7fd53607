"""How a checkpoint's model and optimizer were split across ranks, and which changes of that split a load
can make (through a universal checkpoint, ``universal.py``).

Pure values and rules, no torch: ``deepy.py`` asks them before launch (``resume_checks.py``, from the layout a
checkpoint recorded and the one the config plans), the ranks again when they load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron.errors import CheckpointError


@dataclass(frozen=True)
class Layout:
    """How the model and optimizer were split across ranks."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    pipeline: bool = False
    """Wrapped in DeepSpeed's PipelineModule (pipe_parallel_size >= 1): its parameter names
    (``3.attention...``) differ from the plain model's (``layers.2.attention...``)."""
    replicas: int = 1
    """Copies of each ZeRO partition (``sharding_strategy: hsdp``): the ZeRO files hold ``dp / replicas``
    partitions, so an hsdp checkpoint and a ZeRO-3 one over all ``dp`` ranks are different layouts."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> Layout:
        return Layout(
            tp=int(raw["tp"]),
            pp=int(raw["pp"]),
            dp=int(raw["dp"]),
            zero_stage=int(raw["zero_stage"]),
            pipeline=bool(raw.get("pipeline", False)),
            replicas=int(raw.get("replicas", 1)),
        )

    def __str__(self) -> str:
        kind = "pipeline" if self.pipeline else "plain"
        hybrid = f" as {self.replicas} replicas" if self.replicas > 1 else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{hybrid} zero={self.zero_stage} ({kind} model)"


def needs_universal(saved: Layout, current: Layout) -> bool:
    """Whether DeepSpeed's native loader cannot read ``saved`` into ``current``."""
    if saved == current:
        return False
    if saved.pipeline != current.pipeline:
        return True  # rejected by check_convertible with the reason
    if saved.zero_stage == 0 and current.zero_stage == 0 and (saved.tp, saved.pp) == (current.tp, current.pp):
        return False  # dp-only change without ZeRO: every mp_rank file holds the full optimizer
    return True


def check_convertible(saved: Layout, current: Layout, *, moe: bool = False) -> None:
    """Reject layout changes Deepy cannot make, with what to do instead."""
    if moe and (saved.pipeline != current.pipeline or {saved.zero_stage, current.zero_stage} & {0, 3}):
        raise CheckpointError(
            f"cannot load a mixture-of-experts checkpoint saved at {saved} into a run at {current}: layout changes "
            "of MoE models go through ZeRO stage 1 or 2 on both sides with the same pipeline wrapping. Load at the "
            "saved layout, or save from a ZeRO-1 run first."
        )
    for side, lay in (("saved", saved), ("loading", current)):
        if lay.zero_stage == 3 and lay.tp > 1:
            # DeepSpeed 0.19.8 reassembles (and cuts) ZeRO-3 tensor-parallel shards only for its own
            # AutoTP layers, not for Megatron-style layers such as ours
            raise CheckpointError(
                f"cannot load a checkpoint saved at {saved} into a run at {current}: the {side} run combines ZeRO "
                "stage 3 with tensor parallelism (model_parallel_size > 1), whose checkpoints cannot change layout. "
                "Use zero_optimization.stage 0, 1 or 2 on that side, or load at the saved layout."
            )
