"""DeepSpeed's ``comms_logger`` as a feature: its summary of the collectives after the last step, and with
``verbose: true`` at every ``log_interval`` step (``comms_report.CommsReport``)."""

from __future__ import annotations

from megatron.training.comms_report import CommsReport
from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks
from megatron.training.train_config import TrainConfig


def build_comms_report(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None unless the DeepSpeed config's ``comms_logger`` is enabled."""
    report = CommsReport(run.deepspeed_config.get("comms_logger"), run.logging.log_interval)
    if not report.enabled:
        return None
    return LoopHooks(name="comms_logger", after_step=report.after_step, at_exit=report.at_exit)
