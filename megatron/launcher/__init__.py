"""Building and running the launch of a resolved config: local, pdsh, mpirun or srun."""

from megatron.launcher.command import check_tools, plan_launch  # noqa: F401
from megatron.launcher.config import LaunchConfig  # noqa: F401
from megatron.launcher.plan import LaunchPlan, worker_argv  # noqa: F401
from megatron.launcher.run import run_plan  # noqa: F401
