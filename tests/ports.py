"""Ports for the runs a test starts with a port of its own choosing (``master_port``, a Slurm daemon).

The kernel's choice (bind to port 0, then close) is not safe while pytest-xdist runs tests side by
side: the kernel can hand the port just released to the next caller, so two workers - or a worker and
a deepy.py picking its own rendezvous port - got the same one ("master_port=... is already in use").
Each worker therefore takes ports from a range of its own, below the kernel's ephemeral range (where
deepy's own picks come from), and skips any port something already listens on.
"""

from __future__ import annotations

import itertools
import os
import socket

BASE = 20000
SPAN = 2000
"""Worker gwN takes ports from BASE + N*SPAN upwards (gw0: 20000-21999, gw1: 22000-23999, ...)."""


def worker_index() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


_next = itertools.count(BASE + worker_index() * SPAN)


def free_port() -> int:
    """A port no other worker hands out and nothing listens on now."""
    limit = BASE + (worker_index() + 1) * SPAN
    for port in _next:
        if port >= limit:
            raise RuntimeError(f"worker {worker_index()} used up its {SPAN} test ports")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    raise AssertionError("unreachable")
