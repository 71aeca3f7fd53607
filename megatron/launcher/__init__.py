"""Building and running the launch of a resolved config: local, pdsh, mpirun or srun.

The names below are imported on first use, not with the package: ``local_ranks`` (the per-node
launcher of a local launch) runs as ``python -m megatron.launcher.local_ranks`` on every launch and
needs nothing but the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron.launcher.command import check_tools, plan_launch  # noqa: F401
    from megatron.launcher.plan import LaunchPlan, worker_argv  # noqa: F401
    from megatron.launcher.run import run_plan  # noqa: F401

_EXPORTS = {
    "check_tools": "command",
    "plan_launch": "command",
    "LaunchPlan": "plan",
    "worker_argv": "plan",
    "run_plan": "run",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
