"""Which hosts and slots DeepSpeed's runner will use: hostfile, include/exclude, num_nodes, num_gpus.

A re-statement of ``deepspeed.launcher.runner``'s resource logic (0.19.8), kept here so deepy.py can
count ranks *before* launching without importing DeepSpeed (whose import prints accelerator
warnings on stdout and costs seconds). ``tests/unit/test_launcher_cmd.py`` checks that both agree.

Formats, as DeepSpeed defines them:
- hostfile lines ``<host> slots=<n>``; ``#`` comments and blank lines ignored.
- include/exclude ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping

from megatron.errors import ConfigError
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.environment import started_by_scheduler, visible_devices
from megatron.launcher.slurm import allocation_pool, in_allocation

# where DeepSpeed's runner looks for a hostfile when none is configured
DEFAULT_HOSTFILE = "/job/hostfile"

_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def parse_hostfile(lines: Iterable[str], path: str = "hostfile") -> dict[str, int]:
    """host -> slot count, in file order."""
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.search(line)
        if not match:
            raise ConfigError(f"hostfile={path!r} line {number}: {line!r} is not '<host> slots=<n>'")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise ConfigError(f"hostfile={path!r} line {number}: host {host!r} is listed twice")
        pool[host] = slots
    if not pool:
        raise ConfigError(f"hostfile={path!r} lists no hosts: write one '<host> slots=<n>' line per node")
    return pool


def _parse_filter(text: str) -> dict[str, list[int]]:
    """``worker-0@worker-1:0,2`` -> {worker-0: [], worker-1: [0, 2]} ([] = the whole host)."""
    specs: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        try:
            ids = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise ConfigError(f"{text!r}: slot ids must be integers in NAME:SLOT[,SLOT...]") from None
        specs[host] = sorted(set(specs.get(host, []) + ids))
    return specs


def filter_pool(pool: dict[str, int], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """Slots left after ``include`` or ``exclude`` (mutually exclusive), in hostfile order."""
    key = "include" if include else "exclude"
    if include and exclude:
        raise ConfigError(f"include={include!r} and exclude={exclude!r} are both set: keep one of them")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    text = include or exclude
    if not text:
        return active
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in active.items()}
    for host, slots in _parse_filter(text).items():
        if host not in active:
            raise ConfigError(f"{key}={text!r}: host {host!r} is not in the resource pool {sorted(pool)}")
        for slot in slots:
            if slot not in active[host]:
                raise ConfigError(
                    f"{key}={text!r}: host {host!r} has no slot {slot} (it has {len(active[host])})"
                )
        if include:
            chosen[host] = slots or active[host]
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return {host: chosen[host] for host in active if chosen.get(host)}


def apply_counts(active: dict[str, list[int]], num_nodes: int, num_gpus: int) -> dict[str, list[int]]:
    """Keep the first ``num_nodes`` hosts; give each ``num_gpus`` slots (> 0 means set)."""
    if num_nodes > 0:
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        # the first num_gpus of the host's slots (its visible devices on this machine); DeepSpeed's
        # own runner counts from 0, which is the same for a hostfile's slots
        active = {host: slots[:num_gpus] if num_gpus <= len(slots) else list(range(num_gpus))
                  for host, slots in active.items()}
    return active


def local_slots(environ: Mapping[str, str], count: int) -> list[int]:
    """This machine's device ids for a local launch: those ``CUDA_VISIBLE_DEVICES`` lists, when they are
    ``count`` integer ids (DeepSpeed's runner turns them into ``include=localhost:<ids>``), else 0..count-1.

    The per-node launcher gives each rank ``CUDA_VISIBLE_DEVICES`` = these slots, so counting from 0
    with ``4,5`` visible would hand the ranks GPUs 0 and 1: someone else's."""
    listed = visible_devices(environ)
    if len(listed) == count and all(entry.isdigit() for entry in listed):
        return [int(entry) for entry in listed]
    return list(range(count))


def _read_hostfile(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_hostfile(handle.readlines(), path)
    except OSError as err:
        raise ConfigError(
            f"hostfile={path!r} cannot be read ({err.strerror}): fix the path or remove hostfile"
        ) from None


def scheduler_world(config: DeepSpeedRunnerArgs, environ: Mapping[str, str]) -> int | None:
    """The world size when deepy itself runs as one task of srun/mpirun (then it runs in place)."""
    source = started_by_scheduler(environ, slurm=config.deepspeed_slurm, mpi=config.deepspeed_mpi)
    return None if source is None else int(environ[source.world_size])


def uses_local_pool(config: DeepSpeedRunnerArgs, environ: Mapping[str, str]) -> bool:
    """True when the ranks run on this machine only, sized by num_gpus or the device count."""
    return (
        config.launcher != "slurm"
        and not (config.launcher == "torchrun" and in_allocation(environ))
        and scheduler_world(config, environ) is None
        and not config.hostfile
        and not os.path.isfile(DEFAULT_HOSTFILE)
        and not (config.include or config.exclude)
    )


def resource_pool(
    config: DeepSpeedRunnerArgs, environ: Mapping[str, str], local_devices: Callable[[], int],
    warnings: list[str] | None = None,
) -> dict[str, list[int]]:
    """Every slot the launcher may use: the Slurm allocation, the hostfile, or this machine.

    Checking a config on a login node (outside an allocation) for ``launcher: slurm`` trusts
    ``num_nodes`` x ``num_gpus``; the launch itself needs the allocation. A ``hostfile`` that does not
    exist is DeepSpeed's case too: its runner warns and uses this machine, and so do we, unless the
    launch needs hosts from it.
    """
    world = scheduler_world(config, environ)
    if world is not None:
        return {"(started by the scheduler)": list(range(world))}
    if config.launcher == "torchrun":
        if in_allocation(environ):  # srun starts an agent on each node of the allocation
            return allocation_pool(environ)
    if config.launcher == "slurm":
        if config.hostfile and os.path.isfile(config.hostfile):
            raise ConfigError(
                f"hostfile={config.hostfile!r} with launcher='slurm': the Slurm allocation names the nodes; "
                f"remove hostfile (use include/exclude or num_nodes to narrow the allocation)"
            )
        if config.hostfile and warnings is not None:
            warnings.append(f"hostfile={config.hostfile!r} does not exist; not needed: srun starts the ranks on "
                            f"the nodes of the Slurm allocation")
        if in_allocation(environ) or config.num_gpus is None:
            return allocation_pool(environ)
        return {f"(slurm node {i})": list(range(config.num_gpus)) for i in range(max(config.num_nodes, 1))}
    path = config.hostfile or (DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None)
    if path is not None and not os.path.isfile(path):
        named = [spec.partition(":")[0] for spec in (config.include or config.exclude or "").split("@") if spec]
        if config.num_nodes > 1 or any(host not in ("localhost", "127.0.0.1") for host in named):
            raise ConfigError(
                f"hostfile={path!r} does not exist, and the launch needs hosts from it (num_nodes="
                f"{config.num_nodes}, include/exclude={config.include or config.exclude!r}): fix the path"
            )
        if warnings is not None:
            warnings.append(f"hostfile={path!r} does not exist: launching on this machine only (as DeepSpeed's "
                            f"runner does)")
        path = None
    if path is None:
        if config.num_nodes > 1:
            raise ConfigError(
                f"num_nodes={config.num_nodes} but no hostfile lists other nodes: add hostfile: <path> "
                f"(lines like 'node1 slots=8')"
            )
        return {"localhost": local_slots(environ, local_devices())}
    return {host: list(range(slots)) for host, slots in _read_hostfile(path).items()}


def select_active(config: DeepSpeedRunnerArgs, pool: dict[str, list[int]]) -> dict[str, list[int]]:
    """The slots of ``pool`` left by include/exclude, num_nodes and num_gpus (DeepSpeed's rules)."""
    if (config.include or config.exclude) and (config.num_nodes > 0 or config.num_gpus is not None):
        key = "include" if config.include else "exclude"
        raise ConfigError(
            f"{key}={config.include or config.exclude!r} together with num_nodes={config.num_nodes}/"
            f"num_gpus={config.num_gpus}: DeepSpeed's runner accepts either a host filter or counts; remove one"
        )
    if config.include or config.exclude:  # DeepSpeed's slot numbers, counted from 0 on every host
        filtered = filter_pool({host: len(slots) for host, slots in pool.items()}, config.include or "",
                               config.exclude or "")
    else:  # the pool's own ids (this machine's visible devices)
        filtered = {host: list(slots) for host, slots in pool.items()}
    active = apply_counts(filtered, config.num_nodes, -1 if config.num_gpus is None else config.num_gpus)
    if not active:
        raise ConfigError("no ranks left to launch after include/exclude: check include/exclude/hostfile")
    return active


def active_resources(
    config: DeepSpeedRunnerArgs, environ: Mapping[str, str], local_devices: Callable[[], int],
    warnings: list[str] | None = None,
) -> dict[str, list[int]]:
    """host -> slot ids the ranks run on, as DeepSpeed's runner would choose them."""
    pool = resource_pool(config, environ, local_devices, warnings)
    if scheduler_world(config, environ) is not None:
        return pool  # the scheduler already placed every rank
    return select_active(config, pool)
