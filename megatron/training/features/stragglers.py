"""``straggler_factor`` as a feature: each rank's own work per step taken after every step, judged against the other
ranks' at log steps (a collective: every rank), which adds ``straggler/*`` to the row (``stragglers.py``)."""

from __future__ import annotations

from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks
from megatron.training.train_config import TrainConfig
from megatron.training.stragglers import StragglerWatch


def build_stragglers(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None with ``straggler_factor: null``."""
    keys = run.stragglers
    if keys.straggler_factor is None:
        return None
    watch = StragglerWatch(keys.straggler_factor, keys.straggler_window, setup.rank, setup.metrics_dir, setup.say)
    return LoopHooks(name="stragglers", after_update=lambda _eng, _state: watch.end_step(),
                     log_metrics=lambda _eng, state: watch.check(state.iteration))
