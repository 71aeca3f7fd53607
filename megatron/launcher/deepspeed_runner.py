"""``launcher: pdsh`` (the default): DeepSpeed's runner starts the ranks.

On several hosts (or with ``force_multi``) DeepSpeed's runner runs DeepSpeed's per-node launcher
(``deepspeed.launcher.launch``) on every host through pdsh over ssh; that launcher starts one worker
per slot with RANK/LOCAL_RANK/WORLD_SIZE set.

On this machine alone (no hostfile) deepy starts the ranks through its own per-node launcher
(``local_ranks.py``): it gives each worker what DeepSpeed's launcher would, without importing DeepSpeed
and torch first (DeepSpeed's runner and launcher together cost each launch about 4 s of a CPU's time
before the first rank started).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron import devices
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.logging.config import LoggingArgs
from megatron.launcher.plan import CONFIG_FLAG, LaunchPlan, PlanInputs
from megatron.launcher.rendezvous import check_first_host_reachable, rendezvous
from megatron.launcher.watchdog import launcher_environment


def runner_flags(config: DeepSpeedRunnerArgs, logging: LoggingArgs, master_port: int,
                 master_addr: str | None = None) -> list[str]:
    """Flags for ``python -m deepspeed.launcher.runner`` (before the user script)."""
    out: list[str] = []
    for flag, value in (
        ("--hostfile", config.hostfile),
        ("--include", config.include),
        ("--exclude", config.exclude),
        ("--master_addr", master_addr),
    ):
        if value:
            out += [flag, str(value)]
    if config.num_nodes > 0:
        out += ["--num_nodes", str(config.num_nodes)]
    if config.num_gpus is not None:
        out += ["--num_gpus", str(config.num_gpus)]
    out += ["--master_port", str(master_port), "--launcher", "pdsh"]
    # DeepSpeed's runner and per-node launcher log at INFO unless told otherwise
    out += ["--log_level", logging.deepspeed_log_level]
    if config.force_multi:
        out.append("--force_multi")
    if config.no_ssh_check:
        out.append("--no_ssh_check")
    return out


def runner_argv(flags: list[str], inputs: PlanInputs) -> list[str]:
    return [inputs.python, "-u", "-m", "deepspeed.launcher.runner", *flags,
            inputs.user_script, CONFIG_FLAG, inputs.config_path]  # fmt: skip


def local_ranks_argv(inputs: PlanInputs, master_port: int) -> list[str]:
    """``python -m megatron.launcher.local_ranks``: one worker per slot of this machine, rendezvous on
    loopback (as DeepSpeed's runner arranges for one host)."""
    (slots,) = inputs.active.values()
    return [inputs.python, "-u", "-m", "megatron.launcher.local_ranks", f"--slots={','.join(map(str, slots))}",
            "--master_addr=127.0.0.1", f"--master_port={master_port}",
            inputs.user_script, CONFIG_FLAG, inputs.config_path]  # fmt: skip


def _local_accelerator(environ: Mapping[str, str]) -> dict[str, str]:
    """On a machine without a GPU, tell DeepSpeed so (``DS_ACCELERATOR=cpu``, unless the user chose):
    its auto-detection would print "unable to detect" a warning in every process of a local launch.
    Only for local launches: the ranks run on this machine, so what it has is what they have."""
    if "DS_ACCELERATOR" in environ or devices.gpu_count():
        return {}
    return {"DS_ACCELERATOR": "cpu"}


def plan_deepspeed_runner(inputs: PlanInputs) -> LaunchPlan:
    config = inputs.config
    hosts = list(inputs.active)
    multi = config.force_multi or len(hosts) > 1
    check_first_host_reachable(config, hosts)
    meeting = rendezvous(config, hosts[0], inputs.master_port_given)
    # One host: the runner itself uses 127.0.0.1. Several: name the address when it is known
    # here, else the runner asks the first host for it over ssh (``hostname -I``).
    addr = config.master_addr or (meeting.addr if multi and meeting.local else None)
    on_this_machine = not multi and not config.hostfile
    if on_this_machine:
        argv = local_ranks_argv(inputs, meeting.port)
    else:
        argv = runner_argv(runner_flags(config, inputs.logging, meeting.port, addr), inputs)
    return LaunchPlan(
        argv=argv,
        env={**_local_accelerator(inputs.environ), **launcher_environment()} if not multi else {},
        mode="pdsh" if multi else "local",
        world_size=inputs.world_size,
        config_path=inputs.config_path,
        tools=("pdsh",) if multi else (),
        stop_route="pdsh" if multi else "ranks",
        hosts=tuple(hosts),
        master_addr=meeting.addr,
        master_port=meeting.port,
    )
