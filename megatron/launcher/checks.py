"""Before-launch checks of the launcher's keys (``megatron/launcher/config.py``), and whether the ranks
run on this machine at all (the other checks ask before they judge by this machine's devices).
Registered with every other check (``megatron/config_rules.py``).
"""

from __future__ import annotations

import os
from typing import cast

from megatron.config_rules import RuleContext, rule
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.resources import DEFAULT_HOSTFILE


def runs_on_this_machine(ctx: RuleContext) -> bool:
    """A single-node launch from here: only then does this machine's device say anything.

    deepy.py often runs on a login node without GPUs that pdsh/srun/mpirun launch from: a hostfile
    that exists, several nodes, ``force_multi``, ``launcher: slurm`` (srun on the allocation's nodes)
    or srun/mpirun starting the ranks themselves (``deepspeed_slurm``/``deepspeed_mpi``) all mean the
    ranks run elsewhere, with the ``num_gpus``/``num_nodes`` the user gave.
    """
    return not launches_elsewhere(cast(DeepSpeedRunnerArgs, ctx.args))  # NeoXArgs holds every key it names


def launches_elsewhere(args: DeepSpeedRunnerArgs) -> bool:
    """The ranks start on other machines (or under srun/mpirun), see :func:`runs_on_this_machine`."""
    hostfile = args.hostfile or (DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None)
    return bool(
        (hostfile and os.path.isfile(hostfile))
        or args.force_multi
        or (args.num_nodes or -1) > 1
        or args.launcher == "slurm"
        or args.deepspeed_slurm
        or args.deepspeed_mpi
    )


@rule
def slurm_only_keys(ctx: RuleContext) -> list[str]:
    launcher = ctx.get("launcher") or "pdsh"
    keys = [key for key in ("comment", "account") if ctx.get(key)]
    if not keys or launcher == "slurm":
        return []
    return [f"{', '.join(ctx.show(k) for k in keys)} only apply to srun: set launcher: slurm or remove them"]


@rule
def requeue_keys_need_slurm(ctx: RuleContext) -> list[str]:
    """``slurm_requeue``/``max_requeues_without_progress`` act where deepy starts the ranks with srun in an sbatch
    job (megatron/launcher/requeue.py); set for another launcher they would be accepted and ignored."""
    keys = [key for key in ("slurm_requeue", "max_requeues_without_progress") if ctx.given(key)]
    if not keys or (ctx.get("launcher") or "pdsh") == "slurm":
        return []
    return [f"{', '.join(ctx.show(k) for k in keys)} only apply to a Slurm batch job whose ranks deepy starts with "
            f"srun: set launcher: slurm or remove them"]


@rule
def one_environment_mapping(ctx: RuleContext) -> list[str]:
    if ctx.get("deepspeed_mpi") and ctx.get("deepspeed_slurm"):
        return [
            f"both {ctx.show('deepspeed_mpi')} and {ctx.show('deepspeed_slurm')}: ranks take their "
            f"rank/world size from MPI or from Slurm, keep one"
        ]
    return []
