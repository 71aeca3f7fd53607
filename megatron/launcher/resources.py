"""Which hosts and slots DeepSpeed's runner will use: hostfile, include/exclude, num_nodes, num_gpus.

A re-statement of ``deepspeed.launcher.runner``'s resource logic (0.19.8), kept here so deepy.py can
count ranks *before* launching without importing DeepSpeed (whose import prints accelerator
warnings on stdout and costs seconds). ``tests/unit/test_launcher_cmd.py`` checks that both agree.

Formats, as DeepSpeed defines them:
- hostfile lines ``<host> slots=<n>``; ``#`` comments and blank lines ignored.
- include/exclude ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from megatron.errors import ConfigError

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
        active = {host: list(range(num_gpus)) for host in active}
    return active
