"""Launching inside a Slurm allocation: the allocation is the resource pool and ``srun`` starts the ranks.

deepy.py runs in the batch step of an ``sbatch`` job (see ``tools/slurm/train.sbatch``) or in an
``salloc`` shell, reads the allocation from Slurm's variables, and runs one ``srun`` job step with
one task per rank. Each task is the worker itself (no ssh, no per-node launcher); it finds its
place from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS`` and the rendezvous from the
``MASTER_ADDR``/``MASTER_PORT`` that deepy exports to the step
(:mod:`megatron.launcher.environment`).

Why not DeepSpeed's runner (``--launcher slurm``): in 0.19.8 it wants a hostfile naming the nodes
Slurm already knows, adds ``--gpus-per-node`` (refused by clusters without GPU gres), has no
``--comment``/``--account`` flags, and does not ask srun to end the step when one rank fails, so
the other ranks wait in a collective until the rendezvous times out.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence

from megatron.errors import ConfigError
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.plan import LaunchPlan, PlanInputs
from megatron.launcher.rendezvous import rendezvous

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise ConfigError(f"cannot read SLURM_TASKS_PER_NODE={text!r} (expected e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        raise ConfigError(f"launcher='slurm' needs Slurm's scontrol, and 'scontrol {' '.join(args)}' failed: {err}") from None
    if done.returncode != 0:
        raise ConfigError(f"'scontrol {' '.join(args)}' failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """Every host of a Slurm hostlist (``node[1-3]`` -> node1 node2 node3), as Slurm expands it."""
    return _scontrol("show", "hostnames", nodelist).split()


def node_address(host: str) -> str:
    """The address Slurm itself uses to reach ``host`` (``NodeAddr``), where the ranks rendezvous.

    A node's name need not resolve on the network (``NodeName=gpu1 NodeAddr=10.0.0.7``); its
    ``NodeAddr`` does, since slurmctld connects to it.
    """
    for token in _scontrol("show", "node", "-o", host).split():
        key, _, value = token.partition("=")
        if key == "NodeAddr" and value:
            return value
    return host


def allocation_pool(environ: Mapping[str, str]) -> dict[str, list[int]]:
    """host -> task slots of the allocation deepy runs in (the batch step or an salloc shell)."""
    if not in_allocation(environ):
        raise ConfigError(
            "launcher='slurm' runs inside a Slurm allocation, and SLURM_JOB_ID is not set: submit with "
            "sbatch (see tools/slurm/train.sbatch) or start deepy.py from an salloc shell"
        )
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    hosts = hostnames(nodelist)
    per_node_text = environ.get("SLURM_TASKS_PER_NODE") or f"1(x{len(hosts)})"
    counts = expand_tasks_per_node(per_node_text)
    if len(counts) != len(hosts):
        raise ConfigError(
            f"the allocation lists {len(hosts)} node(s) ({nodelist}) but SLURM_TASKS_PER_NODE={per_node_text!r} "
            f"describes {len(counts)}"
        )
    return {host: list(range(count)) for host, count in zip(hosts, counts)}


def check_whole_hosts(active: Mapping[str, list[int]]) -> None:
    """srun places tasks by count: it cannot pick device ids on a host."""
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise ConfigError(
                f"launcher='slurm' cannot start ranks on chosen slots {slots} of {host!r} (srun places "
                f"tasks by count): filter whole hosts in include/exclude, or set num_gpus"
            )


def srun_argv(
    config: DeepSpeedRunnerArgs,
    active: Mapping[str, list[int]],
    pool: Mapping[str, list[int]],
    worker: Sequence[str],
    cpus_per_task: str | None = None,
) -> list[str]:
    """One job step with a task per rank on the ``active`` hosts of the allocation ``pool``."""
    check_whole_hosts(active)
    counts = [len(slots) for slots in active.values()]
    argv = ["srun", f"--nodes={len(active)}", f"--ntasks={sum(counts)}"]
    if len(set(counts)) == 1:
        argv.append(f"--ntasks-per-node={counts[0]}")
    if list(active) != list(pool):
        argv.append(f"--nodelist={','.join(active)}")
    if cpus_per_task:
        # since Slurm 22.05 a job step no longer inherits the batch job's --cpus-per-task: without it
        # each rank would get one core (its data prefetching and torch's threads included)
        argv.append(f"--cpus-per-task={cpus_per_task}")
    # one failed rank ends the step at once instead of leaving the others in a collective
    argv.append("--kill-on-bad-exit=1")
    if config.comment:
        argv.append(f"--comment={config.comment}")
    if config.account:
        argv.append(f"--account={config.account}")
    # the user's whole environment, plus MASTER_ADDR/PORT set by deepy, reaches every task; values
    # travel by environment, never on the command line (secrets such as WANDB_API_KEY included)
    argv.append("--export=ALL")
    return [*argv, *worker]


def plan_slurm(inputs: PlanInputs) -> LaunchPlan:
    """``srun`` inside the allocation; the rendezvous is the first active host's Slurm address."""
    allocation_pool(inputs.environ)  # a real launch needs the allocation (a config check does not)
    hosts = list(inputs.active)
    here = inputs.environ.get("SLURMD_NODENAME")
    meeting = rendezvous(
        inputs.config,
        node_address(hosts[0]),
        inputs.master_port_given,
        first_host_is_here=(here == hosts[0]) if here else None,
    )
    env = {"MASTER_ADDR": meeting.addr, "MASTER_PORT": str(meeting.port)}
    return LaunchPlan(
        argv=srun_argv(inputs.config, inputs.active, inputs.pool, inputs.worker,
                       inputs.environ.get("SLURM_CPUS_PER_TASK")),
        mode="srun",
        world_size=inputs.world_size,
        config_path=inputs.config_path,
        env=env,
        tools=("srun", "scontrol"),
        stop_route="launcher",  # srun passes SIGUSR1 on to every task (SIGTERM would kill them)
        hosts=tuple(hosts),
        master_addr=meeting.addr,
        master_port=meeting.port,
    )
