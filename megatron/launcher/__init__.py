"""Building and running the launch of a resolved config around DeepSpeed's runner."""

from megatron.launcher.command import LaunchPlan, plan_launch, runner_argv, worker_argv  # noqa: F401
from megatron.launcher.run import launch  # noqa: F401
