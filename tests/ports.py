"""Ports for the runs a test starts with a port of its own choosing (``master_port``, a Slurm daemon).

The kernel's choice (bind to port 0, then close) is not safe while pytest-xdist runs tests side by
side: the kernel can hand the port just released to the next caller, so two workers - or a worker and
a deepy.py picking its own rendezvous port - got the same one ("master_port=... is already in use").
Each worker therefore takes ports from a range of its own, below the kernel's ephemeral range (deepy's
own picks lie above it), and skips any port something already listens on.

Several pytest sessions on one machine (developers or agents testing side by side) would still share
those ranges; ``DEEPY_TEST_PORT_SLOT=K`` (0-6) moves a whole session to a block of its own.
"""

from __future__ import annotations

import itertools
import os
import socket

BASE = 20000
SPAN = 600
"""Worker gwN takes ports from its session's block + N*SPAN upwards (gw0: 20000-20599, gw1: 20600-21199, ...)."""
WORKERS_PER_SLOT = 3
SLOTS = 7
"""Session blocks of WORKERS_PER_SLOT*SPAN ports each; the last ends below the ephemeral range (32768)."""


def worker_index() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def session_slot() -> int:
    slot = int(os.environ.get("DEEPY_TEST_PORT_SLOT", "0"))
    if not 0 <= slot < SLOTS:
        raise RuntimeError(f"DEEPY_TEST_PORT_SLOT must be 0..{SLOTS - 1}, not {slot}")
    return slot


def _start() -> int:
    if worker_index() >= WORKERS_PER_SLOT:
        raise RuntimeError(f"tests/ports.py gives ports to {WORKERS_PER_SLOT} xdist workers per session")
    return BASE + session_slot() * WORKERS_PER_SLOT * SPAN + worker_index() * SPAN


_next = itertools.count(_start())


def free_port() -> int:
    """A port no other worker hands out and nothing listens on now."""
    limit = _start() + SPAN
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
