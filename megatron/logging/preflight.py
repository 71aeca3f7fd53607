"""Logging, tracker and profiling checks that run before launch (registered as one config rule).

A tracker asked for must be importable here — W&B or TensorBoard missing is a clear error before
any rank starts, not a crash on rank 0 after the model is built, and never a silent no-op. The
import is real (not just "is it installed"): a broken install (e.g. a protobuf mismatch under
tensorboard) is caught too. The importer is injected so tests can simulate a missing package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from megatron.errors import ConfigError
from megatron.logging.config import LoggingConfig, TensorboardSettings, WandbSettings

if TYPE_CHECKING:
    from megatron.neox_arguments.rules import RuleContext

# tracker type -> (module the tracker imports, pip package)
_MODULES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
}


def logging_problems(ctx: RuleContext, *, local: bool,
                     import_module: Callable[[str], ModuleType] = importlib.import_module) -> list[str]:
    try:
        config = LoggingConfig.from_args(ctx.args)
    except ConfigError as err:
        return [err.message]
    problems: list[str] = []
    for tracker in config.trackers:
        if not isinstance(tracker, (WandbSettings, TensorboardSettings)):
            continue
        module, package = _MODULES[tracker.type]
        try:
            import_module(module)
        except ImportError as err:
            problems.append(
                f"{ctx.show(tracker.source)} asks for {tracker.type}, but the '{package}' package cannot be "
                f"imported here ({err}): pip install -r requirements/requirements.txt (it pins {package}), "
                f"or remove {tracker.source}"
            )
    p = config.profile
    if p.any and p.stop <= p.start:
        keys = "profile" if p.torch_profiler else "memory_profiling"
        problems.append(
            f"{ctx.show(keys)} records steps {ctx.show('profile_step_start')} to {ctx.show('profile_step_stop')}: "
            f"the stop step must come after the start step"
        )
    if p.memory_snapshot and local and not ctx.device.cuda:
        problems.append(
            f"{ctx.show('memory_profiling')} records the CUDA allocator's history and this machine has no GPU: "
            f"remove memory_profiling (profile: true writes CPU traces)"
        )
    return problems
