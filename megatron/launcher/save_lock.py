"""One training run at a time per ``save`` directory: the lock deepy.py holds while its run trains there.

Two runs started into the same ``save`` directory would resume from the same checkpoint, replace each
other's checkpoints and interleave their metrics. deepy.py therefore takes ``<save>/.deepy-run.lock``
before anything is written or started, holds it until its ranks have ended, and refuses a second
launch while it is held (exit code 2, naming the run that holds it). Only launches that write into
``save`` take it: ``deepy.py --dry-run`` and generate.py/eval.py (which read a checkpoint) do not, and
are not stopped by it (the dry run says that a launch would be refused).

A crashed run must not leave the directory stuck, so the lock says who holds it and is checked:

- **Who.** The lock is a small JSON file: the holder's pid, host name, the kernel's boot id and pid
  namespace, and the process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), with
  the wall-clock start, the command line and the run's name and directory for the message. It is
  written whole to a private file and published with ``link()`` (atomic, and fails if a lock exists, also
  on NFS), so a reader never sees half of one.
- **Same machine** (same host name, boot and pid namespace): the holder is alive when a process with its
  pid runs *and* started at the recorded time. A dead pid, or a pid reused by another process, is stale
  at once: the next launch right after a crash (``kill -9``, OOM, a reboot) is not refused.
- **Another machine** (a shared file system: the head node of one job, a login node of another): its
  pid cannot be looked at from here. The holder touches the lock every :data:`HEARTBEAT_S` seconds (a
  thread of deepy.py, running while the run does); a lock not touched for :data:`STALE_AFTER_S` seconds
  is stale. The age is taken between two times of the same clock, the file server's: the lock's mtime
  and that of a probe file written next to it just now, so clock skew between hosts does not count; the
  margin (10 heartbeats) covers NFS's attribute caching (``acregmax``, 60 s by default). A run that
  crashed on another host thus blocks its ``save`` directory for at most :data:`STALE_AFTER_S`; the
  message says so, and that the lock file may be removed by hand.

A stale lock is taken over with a one-line note: it is first renamed aside (only one launch can) and
checked to be the one judged stale, so two launches finding the same stale lock do not both start.

Where srun/mpirun start deepy.py once per rank (``deepspeed_slurm``/``deepspeed_mpi`` in place), the
task of global rank 0 takes the lock; the others do not look.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.launcher.watchdog import process_identity

LOCK_NAME = ".deepy-run.lock"
HEARTBEAT_S = 30.0
"""How often the holder touches its lock (a lock from another machine is judged by this)."""
STALE_AFTER_S = 300.0
"""A lock from another machine not touched for this long is left by a run that is gone."""


@dataclass(frozen=True)
class Holder:
    """The deepy.py that holds (or held) a ``save`` directory, as its lock records it."""

    pid: int
    host: str
    boot_id: str
    pid_namespace: str
    start_ticks: str
    """``/proc/<pid>/stat`` field 22: with the pid, this process and no other."""
    started: float
    """When the run was started (``time.time()``), for the message."""
    command: str
    run_name: str
    run_dir: str
    token: str
    """Random: tells this lock from another one of the same process."""

    def describe(self) -> str:
        """``deepy.py pid 4242 on host h1, started 2025-06-01 12:00:03, run 20250601-120003-ab12 (logs/...):
        python deepy.py train.py ...``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        run = f", run {self.run_name}" if self.run_name else ""
        where = f" ({self.run_dir})" if self.run_dir else ""
        command = self.command if len(self.command) <= 200 else self.command[:197] + "..."
        return f"deepy.py pid {self.pid} on host {self.host}, started {when}{run}{where}: {command}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["boot_id"]), str(data["pid_namespace"]),
                       str(data["start_ticks"]), float(data["started"]), str(data["command"]),
                       str(data["run_name"]), str(data["run_dir"]), str(data["token"]))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process(command: str, run_name: str = "", run_dir: str = "") -> Holder:
    """The lock this deepy.py would write."""
    identity = process_identity(os.getpid()) or f"{os.getpid()}:"
    return Holder(pid=os.getpid(), host=socket.gethostname(), boot_id=_boot_id(), pid_namespace=_pid_namespace(),
                  start_ticks=identity.split(":", 1)[1], started=time.time(), command=command, run_name=run_name,
                  run_dir=run_dir, token=secrets.token_hex(8))  # fmt: skip


def same_machine(holder: Holder) -> bool:
    """The holder's pid means the same process here: same host name, boot and pid namespace."""
    return (holder.host, holder.boot_id, holder.pid_namespace) == (socket.gethostname(), _boot_id(), _pid_namespace())


def _age_s(lock: Path) -> float:
    """Seconds since the lock was last touched, by the file server's clock (a probe file's mtime as now)."""
    mtime = lock.stat().st_mtime
    probe = lock.with_name(f"{LOCK_NAME}.probe-{socket.gethostname()}-{os.getpid()}")
    try:
        probe.write_text("")
        now = probe.stat().st_mtime
        probe.unlink()
    except OSError:  # a directory this launch cannot write (a dry run): this machine's clock
        now = time.time()
    return now - mtime


def judge(holder: Holder | None, lock: Path) -> str | None:
    """Why the lock's holder is still running (None: the lock is stale, left by a run that is gone)."""
    if holder is None:  # unreadable (published whole, so not half-written): judge it by its age alone
        age = _age_s(lock)
        return f"its unreadable lock was touched {age:.0f} s ago" if age < HEARTBEAT_S else None
    if same_machine(holder):
        alive = process_identity(holder.pid) == f"{holder.pid}:{holder.start_ticks}"
        return "that process is running" if alive else None
    age = _age_s(lock)
    if age >= STALE_AFTER_S:
        return None
    return (f"it runs on another machine, whose lock was touched {age:.0f} s ago: a lock not touched for "
            f"{STALE_AFTER_S:.0f} s is taken as left by a run that is gone (remove {lock} if you know it is)")


def _gone_because(holder: Holder | None, lock: Path) -> str:
    if holder is None:
        return "an unreadable lock"
    if not same_machine(holder):
        return f"its lock was not touched for {STALE_AFTER_S:.0f} s"
    return "no such process" if process_identity(holder.pid) is None else "its pid is another process now"


class SaveDirInUse(Exception):
    """Another run holds the ``save`` directory."""

    def __init__(self, holder: Holder | None, lock: Path, why: str) -> None:
        super().__init__(why)
        self.holder = holder
        self.lock = lock
        self.why = why

    def describe(self) -> str:
        who = self.holder.describe() if self.holder is not None else f"the run whose lock is {self.lock}"
        return f"another run is training into it ({who}; {self.why})"


def _read(lock: Path) -> str | None:
    try:
        return lock.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def current_holder(save_dir: str | os.PathLike[str]) -> tuple[Holder | None, str] | None:
    """The running holder of ``save_dir``'s lock and why it counts as running; None when it is free or stale."""
    lock = Path(save_dir) / LOCK_NAME
    text = _read(lock)
    if text is None:
        return None
    holder = Holder.parse(text)
    why = judge(holder, lock)
    return None if why is None else (holder, why)


class SaveLock:
    """The lock of one ``save`` directory, held by this deepy.py (see the module's doc)."""

    def __init__(self, path: Path, holder: Holder) -> None:
        self.path = path
        self.holder = holder
        self.text = json.dumps(asdict(holder))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deepy-save-lock", daemon=True)

    def ours(self) -> bool:
        return _read(self.path) == self.text

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.ours():
                    return
                os.utime(self.path)
            except OSError:
                continue

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this run's."""
        self._stop.set()
        try:
            if self.ours():
                self.path.unlink()
        except OSError:
            pass


def acquire(save_dir: str | os.PathLike[str], holder: Holder,
            takes_over: Callable[[Holder], bool] | None = None) -> tuple[SaveLock, str | None]:
    """Take ``save_dir``'s lock for ``holder`` (creating the directory), its heartbeat started; with a note
    when a stale lock was taken over. Raises :class:`SaveDirInUse` naming the run that holds it. ``takes_over``:
    a holder that looks alive but is known gone (an earlier attempt of the same torchrun job, whose rank 0 ran
    on another node) is taken over as a stale one is."""
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lock = SaveLock(directory / LOCK_NAME, holder)
    mine = directory / f"{LOCK_NAME}.{holder.token}"
    mine.write_text(lock.text, encoding="utf-8")
    note = None
    try:
        for _ in range(10):
            if _publish(mine, lock.path):
                lock._thread.start()
                return lock, note
            text = _read(lock.path)
            if text is None:  # released (or taken aside) meanwhile: try again
                continue
            found = Holder.parse(text)
            why = judge(found, lock.path)
            earlier_attempt = why is not None and found is not None and takes_over is not None and takes_over(found)
            if why is not None and not earlier_attempt:
                raise SaveDirInUse(found, lock.path, why)
            # stale: move it aside (one launch can), and make sure it is the lock judged stale
            aside = directory / f"{LOCK_NAME}.stale-{holder.token}"
            try:
                os.rename(lock.path, aside)
            except FileNotFoundError:
                continue
            if _read(aside) != text:  # another launch published its own lock meanwhile: put it back
                _publish(aside, lock.path)
                aside.unlink(missing_ok=True)
                continue
            aside.unlink(missing_ok=True)
            gone = found.describe() if found is not None else str(lock.path)
            why = "an earlier attempt of this job" if earlier_attempt else _gone_because(found, lock.path)
            note = f"took over the lock of {save_dir} from a run that is gone ({why}): {gone}"
        raise SaveDirInUse(None, lock.path, "its lock kept changing while this launch tried to take it")
    finally:
        mine.unlink(missing_ok=True)


def _publish(source: Path, lock: Path) -> bool:
    """Make ``source``'s content the lock, unless a lock exists: ``link()`` is atomic and fails if the name
    exists (on NFS too); where a file system has no hard links, an exclusive create."""
    try:
        os.link(source, lock)
        return True
    except FileExistsError:
        return False
    except OSError:
        pass
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(source.read_text(encoding="utf-8"))
    return True
