"""Run a planned launch to its end: start it, pass stop requests on to every rank, report how it ended.

Exit code: the launch command's, which is the first failing rank's (DeepSpeed's per-node
launcher, ``srun --kill-on-bad-exit`` and ``mpirun`` all stop the other ranks and pass the failed
rank's code on). A process killed by a signal reads as ``128 + signal``, as in a shell.

Stop requests: SIGTERM (``kill``, ``docker stop``, systemd), SIGINT (Ctrl-C), SIGHUP (the
terminal closed) or SIGUSR1 sent to deepy.py reach every rank as SIGUSR1, on which the ranks finish
their step, save a checkpoint and exit 0 (:mod:`megatron.checkpointing.preemption`); deepy then
exits 0. SIGUSR1 because it is the one signal ``srun`` and ``mpirun`` pass on unchanged (both turn
SIGTERM into killing the job). A second stop request stops the ranks at once. Nothing of the run
outlives deepy on this machine: the launch runs in a session of its own, and whatever is left of
that session when the launch command ends is terminated.

A rank finishes its step and saves on a stop request once its checkpointing is set up, before the first step;
before that train.py ends it cleanly (``megatron/checkpointing/stop_request.py``, installed on its first line),
and a worker without a handler (or a rank in the moment before it) dies of SIGUSR1's default action. So on this
machine
(stop route ``ranks``) deepy sends SIGUSR1 only to ranks that catch (or ignore) it (``SigCgt``/``SigIgn``
in /proc): a request that comes while they are still starting ends them at once instead - no step has
been trained, so nothing can be lost - and deepy says the run was stopped before it began and exits 0. The same for
workers that never take stop requests (generate.py, eval.py: they have nothing to save), which are
just stopped.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from megatron.launcher.plan import LaunchPlan
from megatron.logging import rank_errors
from megatron.launcher.processes import end_session, rank_processes, send, survives

# the directory holding the ``megatron`` package: workers outside the repo must still import it
REPO_ROOT = str(Path(__file__).resolve().parents[2])

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
RANK_STOP_SIGNAL = signal.SIGUSR1
POLL_S = 0.1


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell would report it (signals -> 128 + signal number)."""
    return 128 - returncode if returncode < 0 else returncode


def worker_environment(base: Mapping[str, str], added: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launch's environment: the user's, plus ``added``, plus this repo first on PYTHONPATH.

    The user's PYTHONPATH entries are kept (after ours, so that our ``megatron`` package wins over
    another one of that name); nothing the user set is replaced except by ``added``.
    """
    env = {**base, **(added or {})}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    return env


def pdsh_stop_command(plan: LaunchPlan, signum: int) -> list[str]:
    """``pdsh`` to every host: signal the ranks of this run there (not DeepSpeed's per-node launcher).

    A rank's command line is ``python -u SCRIPT --local_rank=N --deepy_config PATH``; the per-node
    launcher's has no ``--local_rank=``. ``[-]`` keeps the pattern from matching the remote shell
    that runs pkill, whose own command line contains the pattern.
    """
    before = "[-]-local_rank=[0-9]+" if plan.worker_prefix is None else "[" + _regex_escape(plan.worker_prefix)[0] + "]" \
        + _regex_escape(plan.worker_prefix)[1:]
    pattern = f"{before} --deepy_config {_regex_escape(plan.config_path)}( |$)"
    remote = f"pkill -{signal.Signals(signum).name.removeprefix('SIG')} -f -- {shlex.quote(pattern)}"
    return ["pdsh", "-S", "-R", "ssh", "-w", ",".join(plan.hosts), remote]


def _regex_escape(text: str) -> str:
    # pkill takes an extended regular expression (not Python's re syntax)
    return "".join(f"\\{c}" if c in ".[]()*+?{}|^$\\" else c for c in text)


class LaunchSupervisor:
    """Runs one plan in its own session and relays stop requests according to its stop route."""

    def __init__(self, plan: LaunchPlan, env: Mapping[str, str], memory: str | None = None,
                 trains: bool = True) -> None:
        """``memory``: the launch's memory estimate, said beside a rank killed by SIGKILL; ``trains``: the
        workers take stop requests once started (train.py), rather than never (generate.py, eval.py)."""
        self.plan = plan
        self.env = dict(env)
        self.memory = memory
        self.trains = trains
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None
        self.pending: list[int] = []
        self.delivered: set[int] = set()
        self.aborted = False
        self.ended_unready = False
        """A stop request came before the ranks could take it: deepy ended them instead."""

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signum)  # only a note: the loop acts on it

    def run(self) -> int:
        previous: dict[signal.Signals, Any] = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            # its own session: Ctrl-C in the terminal reaches deepy alone, and every process of the
            # run can be found (and ended) by session id even after re-parenting
            # a local launch keeps deepy's stdin: generate.py's interactive mode reads prompts from it
            # (rank 0); remote launchers (pdsh, srun, mpirun) would forward it to every host
            stdin = None if self.plan.mode == "local" else subprocess.DEVNULL
            self.process = subprocess.Popen(self.plan.argv, env=self.env, stdin=stdin, start_new_session=True)
            while self.process.poll() is None:
                self._handle_requests()
                if self.stop_signal is not None and not self.aborted:
                    self._deliver_stop()
                time.sleep(POLL_S)
            self._handle_requests()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        left = end_session(self.process.pid)
        if left:
            print(f"deepy: {len(left)} process(es) of the run outlived the launcher and were stopped: "
                  f"{'; '.join(left)}", flush=True)  # fmt: skip
        return self._result(exit_code(self.process.returncode))

    def _handle_requests(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            name = signal.Signals(signum).name
            if self.stop_signal is None:
                self.stop_signal = signum
                if self.plan.stop_route == "ranks" and not self._ranks_take_stop_requests():
                    self._end_unready()
                    continue
                print(f"deepy: {name}: asking every rank to finish its step, save a checkpoint (when `save` is "
                      f"set) and stop; send it again to stop them at once", flush=True)  # fmt: skip
            elif not self.aborted:
                self.aborted = True
                print(f"deepy: {name} again: stopping the ranks now, without saving", flush=True)
                self._abort()

    def _deliver_stop(self) -> None:
        assert self.process is not None
        route = self.plan.stop_route
        if route == "ranks":
            # look again on every pass and signal each rank once, when it takes the signal
            for proc in rank_processes(self.process.pid, self.plan.config_path):
                if proc.pid in self.delivered or not survives(proc.pid, RANK_STOP_SIGNAL):
                    continue
                if send(proc.pid, RANK_STOP_SIGNAL):
                    self.delivered.add(proc.pid)
        elif not self.delivered:
            self.delivered.add(self.process.pid)
            if route == "launcher":
                send(self.process.pid, RANK_STOP_SIGNAL)
            else:  # pdsh: the ranks live on other hosts, behind ssh
                subprocess.run(pdsh_stop_command(self.plan, RANK_STOP_SIGNAL), env=self.env,
                               stdin=subprocess.DEVNULL, timeout=120, check=False)  # fmt: skip

    def _ranks_take_stop_requests(self) -> bool:
        """Some rank runs here and every one that does catches (or ignores) SIGUSR1 (ranks that ended are not
        looked at: at the end of a run one rank may finish its last saves after the others have exited)."""
        assert self.process is not None
        ranks = rank_processes(self.process.pid, self.plan.config_path)
        return bool(ranks) and all(survives(p.pid, RANK_STOP_SIGNAL) for p in ranks)

    def _end_unready(self) -> None:
        """The ranks cannot take a stop request (not one started yet, or one has no handler): end them.
        None has trained a step (a step needs every rank, and a rank catches SIGUSR1 before its first
        step), so nothing is lost; the per-node launcher stops them on SIGTERM."""
        assert self.process is not None and self.stop_signal is not None
        self.ended_unready = self.aborted = True
        name = signal.Signals(self.stop_signal).name
        why = ("the ranks are still starting (none takes a stop request yet, none has trained a step)"
               if self.trains else "the ranks have nothing to save")
        print(f"deepy: {name}: {why}: stopping them now", flush=True)
        send(self.process.pid, signal.SIGTERM)

    def _abort(self) -> None:
        assert self.process is not None
        if self.plan.stop_route == "ranks" or self.plan.in_place:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            # srun and mpirun end every rank of the job on SIGTERM; DeepSpeed's runner (pdsh) kills
            # its per-node launchers over pdsh
            send(self.process.pid, signal.SIGTERM)

    def _result(self, code: int) -> int:
        if self.ended_unready and self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            if not self.trains:
                print(f"deepy: stopped on {name}", flush=True)
                return 128 + self.stop_signal
            print(f"deepy: stopped on {name} before the run began (the ranks were still starting): nothing was "
                  f"trained or saved, nothing is lost", flush=True)  # fmt: skip
            return 0
        if code != 0 and not self.plan.in_place:
            # the ranks printed the first error once; say which ranks had it, and any other error once (in
            # place, srun/mpirun started one deepy.py per rank: the ranks' own reports are all there is)
            for line in rank_errors.summary(os.path.dirname(self.plan.config_path), self.memory):
                print(line, flush=True)
        if self.stop_signal is None:
            if code != 0:
                print(f"deepy: run failed with exit code {code}", flush=True)
            return code
        name = signal.Signals(self.stop_signal).name
        if code == 0 and not self.aborted:
            print(f"deepy: stopped on {name}: every rank stopped cleanly", flush=True)
            return 0
        print(f"deepy: stopped on {name}; the ranks ended with exit code {code}", flush=True)
        return 128 + self.stop_signal


def launch_line(plan: LaunchPlan, verbose: bool = False) -> str:
    """``deepy: starting 2 ranks on this machine (rendezvous 127.0.0.1:29500)``; with ``verbose``, the
    command that starts them too (on this machine, deepy's own per-node launcher: an internal detail)."""
    ranks = f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}"
    how = "on this machine" if plan.mode == "local" else f"via {plan.mode}"
    where = f" (rendezvous {plan.master_addr}:{plan.master_port})" if plan.master_port is not None else ""
    line = f"deepy: starting {ranks} {how}{where}"
    return f"{line}: {shlex.join(plan.argv)}" if verbose or plan.mode != "local" else line


def run_plan(plan: LaunchPlan, environ: Mapping[str, str], verbose: bool = False, *, memory: str | None = None,
             trains: bool = True) -> int:  # fmt: skip
    """Start ``plan`` and wait for it; returns deepy's exit code. ``memory`` and ``trains``: see
    :class:`LaunchSupervisor`."""
    print(launch_line(plan, verbose), flush=True)
    return LaunchSupervisor(plan, worker_environment(environ, plan.env), memory, trains).run()
