"""``launcher: torchrun``: deepy.py starts torch's elastic agent (``python -m torch.distributed.run``) on every node,
and the agents start the ranks.

- this machine alone: one agent, c10d rendezvous on loopback;
- inside a Slurm allocation: one ``srun`` task per node, each an agent; the rendezvous is the first node's
  Slurm address (``NodeAddr``), the rendezvous id the job's;
- several hosts of a hostfile: pdsh (over ssh) runs an agent on each host.

The workers get ``--deepy_config PATH`` (deepy.py resolved the config once), and their place from torchrun's
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. ``max_restarts`` becomes the agents' ``--max-restarts``: a
rank that dies (or that the hang watch ends) makes every agent restart its workers, which resume from the last
committed checkpoint; deepy.py itself then does not launch again. Users who start torchrun themselves (Kubernetes,
SkyPilot) run ``torchrun ... train.py CONFIG...`` instead: see megatron/app/external_launch.py.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from megatron.errors import ConfigError
from megatron.launcher.plan import CONFIG_FLAG, LaunchPlan, PlanInputs
from megatron.launcher.rendezvous import check_first_host_reachable, rendezvous
from megatron.launcher.slurm import check_whole_hosts, in_allocation, node_address
from megatron.launcher.watchdog import launcher_environment

AGENT_MODULE = "torch.distributed.run"


def agent_argv(python: str, nodes: int, per_node: int, endpoint: str, run_id: str, max_restarts: int,
               worker: Sequence[str], module: str = AGENT_MODULE) -> list[str]:
    """``python -m torch.distributed.run`` with the c10d rendezvous, then the worker script and its arguments."""
    return [python, "-u", "-m", module, f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}", *worker]


def _per_node(inputs: PlanInputs) -> int:
    counts = {len(slots) for slots in inputs.active.values()}
    if len(counts) != 1:
        raise ConfigError(f"launcher='torchrun' starts the same number of workers on every node (--nproc-per-node), "
                          f"and the hosts have {sorted(counts)} slots: set num_gpus")
    return counts.pop()


def plan_torchrun(inputs: PlanInputs) -> LaunchPlan:
    config = inputs.config
    hosts = list(inputs.active)
    per_node = _per_node(inputs)
    worker = [inputs.user_script, CONFIG_FLAG, inputs.config_path]
    run_id = f"deepy-{os.path.basename(os.path.dirname(inputs.config_path)) or 'run'}"
    if in_allocation(inputs.environ):
        check_whole_hosts({host: list(range(len(slots))) for host, slots in inputs.active.items()})
        here = inputs.environ.get("SLURMD_NODENAME")
        meeting = rendezvous(config, node_address(hosts[0]), inputs.master_port_given,
                             first_host_is_here=(here == hosts[0]) if here else None)
        agents = agent_argv(inputs.python, len(hosts), per_node, f"{meeting.addr}:{meeting.port}",
                            f"slurm-{inputs.environ['SLURM_JOB_ID']}", config.max_restarts, worker, module=__name__)
        srun = ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1"]
        if list(inputs.active) != list(inputs.pool):
            srun.append(f"--nodelist={','.join(hosts)}")
        cpus = inputs.environ.get("SLURM_CPUS_PER_TASK")
        if cpus:
            srun.append(f"--cpus-per-task={cpus}")
        srun += ["--kill-on-bad-exit=1", *(f"--{key}={getattr(config, key)}" for key in ("comment", "account")
                                           if getattr(config, key)), "--export=ALL"]
        return LaunchPlan(argv=[*srun, *agents], mode="srun + torchrun", world_size=inputs.world_size,
                          config_path=inputs.config_path, tools=("srun", "scontrol"), stop_route="launcher",
                          hosts=tuple(hosts), master_addr=meeting.addr, master_port=meeting.port,
                          restarts_itself=True)
    multi = len(hosts) > 1 or bool(config.hostfile)
    if not multi:
        meeting = rendezvous(config, hosts[0], inputs.master_port_given)
        argv = agent_argv(inputs.python, 1, per_node, f"127.0.0.1:{meeting.port}", run_id, config.max_restarts, worker)
        return LaunchPlan(argv=argv, env=launcher_environment(), mode="local torchrun", world_size=inputs.world_size,
                          config_path=inputs.config_path, stop_route="ranks", hosts=tuple(hosts),
                          master_addr="127.0.0.1", master_port=meeting.port, restarts_itself=True)
    check_first_host_reachable(config, hosts)
    meeting = rendezvous(config, hosts[0], inputs.master_port_given)
    addr = config.master_addr or meeting.addr
    agents = agent_argv(inputs.python, len(hosts), per_node, f"{addr}:{meeting.port}", run_id, config.max_restarts,
                        worker)
    # as DeepSpeed's pdsh runner does: the same directory and this repository importable on every host (the user's
    # other variables stay where pdsh's ssh puts them: the remote login's)
    # lazy: launcher.run imports psutil, only when a launch runs
    from megatron.launcher.run import REPO_ROOT

    remote = (f"cd {shlex.quote(os.getcwd())} && export PYTHONPATH={shlex.quote(REPO_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}"
              f" && {shlex.join(agents)}")
    return LaunchPlan(argv=["pdsh", "-S", "-R", "ssh", "-w", ",".join(hosts), remote], mode="pdsh + torchrun",
                      world_size=inputs.world_size, config_path=inputs.config_path, tools=("pdsh",),
                      stop_route="pdsh", hosts=tuple(hosts), master_addr=addr, master_port=meeting.port,
                      restarts_itself=True, worker_prefix=f"-u {inputs.user_script}")


def main(argv: Sequence[str]) -> None:
    """``python -m megatron.launcher.torchrun [torchrun's flags] SCRIPT ...``: torchrun on a Slurm node, told the
    node's own Slurm address (``--local-addr``). The rendezvous leader publishes its address for the workers'
    MASTER_ADDR, by default its host name, which need not resolve on the network; ``NodeAddr`` does (slurmctld
    connects to it), as the ``launcher: slurm`` rendezvous uses. One srun command serves every node, so each
    agent looks its own up."""
    node = os.environ.get("SLURMD_NODENAME")
    extra = [f"--local-addr={node_address(node)}"] if node else []
    os.execv(sys.executable, [sys.executable, "-u", "-m", AGENT_MODULE, *extra, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
