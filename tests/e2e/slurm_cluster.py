"""A throwaway two-node Slurm cluster on this machine, for the launch tests.

It runs Debian's ``slurm-wlm`` daemons (installed by ``.ci/run``): one ``slurmctld`` and two
``slurmd``, each node daemon in a UTS namespace of its own (``unshare --uts``) so that it sees its
own hostname and registers as its own node; all listen on 127.0.0.1 on free ports. No munge
(``AuthType=auth/none``), no cgroups (``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``), no GPUs or other gres, no accounting; configuration, state, spool and
logs live in one temporary directory. Jobs therefore see two nodes, ``deepy-n1`` and
``deepy-n2``, whose ranks share this machine's network (so ``NodeAddr`` 127.0.0.1 is reachable
from both).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
NODES = ("deepy-n1", "deepy-n2")
PARTITIONS = ("debug", "low", "urgent")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def missing_reason() -> str | None:
    """Why the cluster cannot start here, or ``None``."""
    missing = [tool for tool in (*DAEMONS, "unshare") if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: Debian's slurm-wlm is not installed (.ci/run installs it with "
            f"'apt-get install -y slurm-wlm'; that step failed or was not run on this machine)"
        )
    return None


_free_port = free_port


class SlurmCluster:
    def __init__(self, root: Path, cpus_per_node: int = 2) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.cpus = cpus_per_node
        self.daemons: list[subprocess.Popen[bytes]] = []

    # --- configuration ---------------------------------------------------------------------------
    def write_config(self) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        lines = [
            "ClusterName=deepytest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/none",
            # a requeued job waits cred_expire + 1 s before it may start again (120 s by default)
            "AuthInfo=cred_expire=10",
            "CredType=cred/none",
            "SlurmUser=root" if os.geteuid() == 0 else f"SlurmUser={os.environ.get('USER', 'nobody')}",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool-%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdLogFile={self.root}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=30",
            "MinJobAge=600",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=CANCEL",
        ]
        for node in NODES:
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={self.cpus} "
                         f"RealMemory=1000 State=UNKNOWN")  # fmt: skip
        nodes = ",".join(NODES)
        lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES "
                     f"PriorityTier=1 PreemptMode=OFF")  # fmt: skip
        # preemption (by partition): a job in "urgent" preempts the jobs of "low", which get SIGCONT and SIGTERM
        # and GraceTime seconds to end before they are cancelled; "debug"'s jobs are never preempted
        lines.append(f"PartitionName=low Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL "
                     f"GraceTime=120")  # fmt: skip
        lines.append(f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF")
        self.conf.write_text("\n".join(lines) + "\n")

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    # --- daemons ---------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log: str) -> None:
        out = open(self.root / log, "ab")  # noqa: SIM115 - lives as long as the daemon
        self.daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env}, start_new_session=True))  # fmt: skip

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.stdout")
        self._wait(lambda: "UP" in self.scontrol("ping").stdout, timeout, "slurmctld to answer")
        for node in NODES:
            # a UTS namespace per node: slurmd finds its NodeName from the hostname it sees
            self._spawn(["unshare", "--uts", "sh", "-c", f"hostname {node} && exec slurmd -D -f {self.conf}"],
                        f"slurmd-{node}.stdout")  # fmt: skip
        self._wait(self._nodes_idle, timeout, "both nodes to be idle")

    def _nodes_idle(self) -> bool:
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [d.args for d in self.daemons if d.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        raise RuntimeError(f"Slurm test cluster: gave up waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, wait for it to end, then stop the daemons (nothing is left running)."""
        try:
            for partition in PARTITIONS:
                # every process of every job, then the jobs themselves
                self.run(["scancel", "--full", "--signal=KILL", f"--partition={partition}"])
                self.run(["scancel", f"--partition={partition}"])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run(["squeue", "-h"]).stdout.strip():
                time.sleep(0.5)
        finally:
            for daemon in reversed(self.daemons):
                if daemon.poll() is None:
                    os.killpg(daemon.pid, signal.SIGTERM)
            for daemon in self.daemons:
                try:
                    daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)
                    daemon.wait(timeout=30)

    # --- clients ---------------------------------------------------------------------------------
    def run(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, **kwargs)  # type: ignore[call-overload]

    def scontrol(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(["scontrol", *args])

    def sbatch(self, argv: list[str], cwd: Path, env: dict[str, str]) -> int:
        done = self.run(["sbatch", "--parsable", *argv], cwd=cwd, env=env)
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed: {done.stderr}\n{self.logs()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        done = self.scontrol("show", "job", "-o", str(job_id))
        fields: dict[str, str] = {}
        for token in done.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: int, timeout: float = 600) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not finish in {timeout} s: {self.job(job_id)}\n{self.logs()}")
