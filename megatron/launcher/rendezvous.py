"""Where rank 0 listens for the others: ``master_addr`` and ``master_port``.

Two runs on one machine must not share a port: the second one's rank 0 cannot listen
(``EADDRINUSE``), and worse, its other ranks may join the first run's rendezvous. So when the
rendezvous host is this machine, a port the user did not choose is picked free here, and a port
the user did choose is checked before anything starts. On another host neither is possible
from here, and the configured port (default 29500) is used as it is.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from megatron.errors import ConfigError
from megatron.launcher.config import DeepSpeedRunnerArgs

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def is_this_machine(host: str) -> bool:
    if host in LOCAL_NAMES or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return host in names


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)
"""Linux's default range of the local ports the kernel gives outgoing connections and ``bind(0)``."""
PORT_STRIDE = 7919
"""A prime: consecutive process ids start their search this far apart (modulo the range)."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``; Linux's default where unreadable)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return low, high


def free_port(pid: int | None = None) -> int:
    """A TCP port nothing listens on now, above the kernel's ephemeral range.

    Not the kernel's own choice (``bind(0)``): that port comes from the ephemeral range, from which
    every outgoing connection - the ranks' gloo connections of a run already going, say - also takes
    its local port, and one did take it in the seconds before rank 0 listened (``EADDRINUSE``). Above
    the range only a program that binds a port by number can hold it. The search starts at a place
    given by the process id, so two deepy launches picking at the same moment start ``PORT_STRIDE``
    apart instead of both taking the first free port. Falls back to the kernel's choice where the
    range leaves fewer than 256 ports above it.
    """
    start, end = ephemeral_range()[1] + 1, 65535
    span = end - start + 1
    if span >= 256:
        first = ((os.getpid() if pid is None else pid) * PORT_STRIDE) % span
        for step in range(span):
            port = start + (first + step) % span
            if not port_in_use(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether binding ``port`` on every address fails (as it would for rank 0's TCP store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as torch's store does: a port left in TIME_WAIT by a finished run is free to reuse
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            return err.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    addr: str
    port: int
    local: bool
    """Rank 0 runs on this machine (so the port was checked, or picked free, here)."""


def check_first_host_reachable(config: DeepSpeedRunnerArgs, hosts: list[str]) -> None:
    """A hostfile whose first host is ``localhost`` cannot host the rendezvous of a multi-host run."""
    first = hosts[0]
    if len(hosts) > 1 and not config.master_addr and (first in LOCAL_NAMES or first.startswith("127.")):
        raise ConfigError(
            f"the first host is {first!r}, which ranks on the other {len(hosts) - 1} host(s) cannot reach: "
            f"name it by its network name in the hostfile, or set master_addr"
        )


def rendezvous(config: DeepSpeedRunnerArgs, first_host: str, master_port_given: bool,
               first_host_is_here: bool | None = None) -> Rendezvous:
    """The address and port of the run's rendezvous.

    ``first_host`` is the address of the host where rank 0 runs; ``first_host_is_here`` says
    whether that is this machine when its name alone cannot tell (a Slurm node's address);
    ``master_port_given``: the user chose ``master_port`` (:func:`~megatron.launcher.config.master_port_chosen`).
    """
    if config.master_addr:
        addr, local = config.master_addr, is_this_machine(config.master_addr)
    else:
        addr = "127.0.0.1" if first_host in LOCAL_NAMES else first_host
        local = is_this_machine(addr) if first_host_is_here is None else first_host_is_here
    if not local:
        return Rendezvous(addr=addr, port=config.master_port, local=False)
    if not master_port_given:
        return Rendezvous(addr=addr, port=free_port(), local=True)
    if port_in_use(config.master_port):
        raise ConfigError(
            f"master_port={config.master_port} is already in use on this machine (another run or program "
            f"listens on it): choose a free port, or remove master_port and deepy picks a free one"
        )
    return Rendezvous(addr=addr, port=config.master_port, local=True)
