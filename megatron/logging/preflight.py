"""Logging, tracker and profiling checks that run before launch (registered as one config rule).

A tracker asked for must be importable here — W&B, TensorBoard or comet_ml missing is a clear error before
any rank starts, not a crash on rank 0 after the model is built, and never a silent no-op; so is a
``wandb_code_dir`` that is not a directory, or that no W&B run would save. The
import is real (not just "is it installed"): a broken install (e.g. a protobuf mismatch under
tensorboard) is caught too. The importer is injected so tests can simulate a missing package.

:func:`trackers_and_profiling`, the check registered with every other (``megatron/config_rules.py``),
hands :func:`logging_problems` the logging keys and how to name a setting (``key=value (file:line)``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

from megatron.config_rules import RuleContext, rule
from megatron.errors import ConfigError
from megatron.logging.config import CometSettings, LoggingArgs, TensorboardSettings, WandbSettings

# tracker type -> (module the tracker imports, pip package)
_MODULES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "comet": ("comet_ml", "comet_ml"),
}


def logging_problems(config: LoggingArgs, show: Callable[[str], str],
                     import_module: Callable[[str], ModuleType] = importlib.import_module) -> list[str]:
    """Problems of ``config`` before launch; ``show(key)`` names a setting as the user wrote it. Whether
    the devices of the machine the ranks run on can record memory snapshots is a rule between this
    component and the launcher (``neox_arguments/rules.py``: ``memory_snapshot_needs_a_gpu``)."""
    problems: list[str] = []
    for tracker in config.tracker_settings():
        if not isinstance(tracker, (WandbSettings, TensorboardSettings, CometSettings)):
            continue
        module, package = _MODULES[tracker.type]
        try:
            import_module(module)
        except ImportError as err:
            problems.append(
                f"{show(tracker.source)} asks for {tracker.type}, but the '{package}' package cannot be "
                f"imported here ({err}): pip install -r requirements/requirements.txt (it pins {package}), "
                f"or remove {tracker.source}"
            )
    code_dir = config.wandb_code_dir
    if code_dir is not None and not os.path.isdir(code_dir):
        problems.append(f"{show('wandb_code_dir')} is not a directory: give the directory whose source files W&B "
                        f"saves with the run, or null to save none")
    elif code_dir is not None and not any(isinstance(t, WandbSettings) for t in config.tracker_settings()):
        problems.append(f"{show('wandb_code_dir')} asks W&B to save code, but no W&B run is asked for: set "
                        f"use_wandb: true (or a tracker of type wandb), or remove wandb_code_dir")
    p = config.profile_settings()
    if p.any and p.stop <= p.start:
        keys = "profile" if p.torch_profiler else "memory_profiling"
        problems.append(
            f"{show(keys)} records steps {show('profile_step_start')} to {show('profile_step_stop')}: "
            f"the stop step must come after the start step"
        )
    return problems


@rule
def trackers_and_profiling(ctx: RuleContext) -> list[str]:
    """Trackers importable, one spelling each, profiling ranges (:func:`logging_problems`)."""
    try:
        return logging_problems(ctx.group(LoggingArgs), ctx.show)
    except ConfigError as err:  # the tracker spellings disagree (LoggingArgs.tracker_settings)
        return [err.message]
