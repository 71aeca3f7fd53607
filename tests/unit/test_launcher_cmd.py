"""Launch commands for each launcher kind, the rendezvous port, and the Slurm/MPI environment mapping.

Nothing is started here: the commands are inspected as argument lists. The same commands run for
real against Slurm, Open MPI and pdsh in tests/e2e/test_slurm.py, test_mpi.py and test_pdsh.py.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron.devices import gpu_driver_present
from megatron.errors import ConfigError
from megatron.launcher import LaunchPlan, check_tools, plan_launch
from megatron.launcher.config import master_port_chosen
from megatron.launcher import local_ranks
from megatron.launcher.deepspeed_runner import runner_flags
from megatron.launcher.environment import distributed_env, first_slurm_host, started_by_scheduler
from megatron.launcher.kinds import LAUNCHERS
from megatron.launcher.mpi import hydra_argv, openmpi_argv
from megatron.launcher.plan import PlanInputs
from megatron.launcher.processes import is_rank_cmdline
from megatron.launcher.rendezvous import ephemeral_range, free_port, port_in_use
from megatron.launcher.run import exit_code, pdsh_stop_command, worker_environment
from megatron.launcher.slurm import expand_tasks_per_node, srun_argv
from megatron.neox_arguments.arguments import NeoXArgs

CONFIG = "runs/20260101-000000/deepy_config.json"
PY = "/usr/bin/python3"
SECRET = "wandb-secret-value-0123456789"
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def config(**values: Any) -> NeoXArgs:
    """The arguments the launcher reads, as deepy.py hands them over."""
    return NeoXArgs(**values)


def plan(environ: dict[str, str] | None = None, devices: int = 1, **values: Any) -> LaunchPlan:
    provenance = {key: "cli" for key in values}  # every key given here was chosen
    args = config(**values)
    return plan_launch(args, "train.py", CONFIG, environ or {}, lambda: devices, python=PY, provenance=provenance,
                       logging=args)


@pytest.fixture()
def hostfile(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=4\n# spare\nnode2 slots=4\n")
    yield str(path)


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# --- config ------------------------------------------------------------------------------------
def test_the_launcher_knows_whether_the_port_was_chosen() -> None:
    args = NeoXArgs(master_port=29500, launcher="slurm", comment="c", deepspeed_slurm=True)
    assert master_port_chosen(args, {"master_port": "run.yml:3"})
    assert not master_port_chosen(args, {})  # the default, untouched
    assert not master_port_chosen(args, {"master_port": "derived"})  # filled in by a rule, not the user
    assert master_port_chosen(NeoXArgs(master_port=29611))  # no provenance: by value
    assert not master_port_chosen(NeoXArgs())


# --- local and pdsh: DeepSpeed's runner --------------------------------------------------------
def test_local_run_starts_our_per_node_launcher_on_a_free_port() -> None:
    p = plan(num_gpus=2)
    assert p.mode == "local" and p.tools == () and p.stop_route == "ranks" and p.world_size == 2
    port = p.master_port
    assert port is not None and port != 29500 and not port_in_use(port)
    assert p.argv == [
        PY, "-u", "-m", "megatron.launcher.local_ranks", "--slots=0,1", "--master_addr=127.0.0.1",
        f"--master_port={port}", "train.py", "--deepy_config", CONFIG,
    ]  # fmt: skip
    # no config blob on the command line: every argument is short and readable
    assert max(len(a) for a in p.argv) < 80
    assert local_ranks.parse(p.argv[4:]).script_args == ["--deepy_config", CONFIG]


@pytest.mark.parametrize("slots", [[0], [0, 1], [0, 1, 2, 3], [2, 3]])
def test_each_rank_gets_what_deepspeeds_launcher_gives_it(monkeypatch: pytest.MonkeyPatch, slots: list[int]) -> None:
    """Our per-node launcher starts each worker with the command and environment DeepSpeed's
    per-node launcher (``deepspeed.launcher.launch``, as its runner starts it for one host) would."""
    import deepspeed.launcher.launch as ds_launch

    started: list[tuple[list[str], dict[str, str]]] = []

    class Done:
        pid, returncode = 1, 0

        def poll(self) -> int:
            return 0

    def popen(cmd: list[str], env: dict[str, str], **_: Any) -> Done:
        started.append((list(cmd), dict(env)))  # DeepSpeed reuses one dict for every rank
        return Done()

    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": slots}).encode()).decode()
    monkeypatch.setattr(ds_launch.subprocess, "Popen", popen)
    monkeypatch.setattr(ds_launch.time, "sleep", lambda s: None)
    monkeypatch.setattr(sys, "argv", ["launch.py", f"--world_info={world_info}", "--master_addr=127.0.0.1",
                                      "--master_port=29611", "train.py", "--deepy_config", CONFIG])  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # replaced in both
    ds_launch.main()
    assert len(started) == len(slots)
    for rank, (cmd, env) in enumerate(started):
        assert local_ranks.rank_command(sys.executable, "train.py", rank, ["--deepy_config", CONFIG]) == cmd
        assert local_ranks.rank_environment(os.environ, slots, rank, "127.0.0.1", 29611) == env


@pytest.mark.parametrize("fork", ["1", "0"])
def test_our_launcher_runs_every_rank_and_a_failure_stops_the_others(tmp_path: Path, fork: str) -> None:
    """Real processes: each worker sees its rank, argv, ``sys.path[0]``, ``__main__`` and ``atexit`` as
    ``python -u SCRIPT`` gives them; when rank 1 fails, rank 0 (which would wait a minute) is ended and
    the failing code is the launcher's. Without a GPU driver the workers are forked from the launcher
    with torch and DeepSpeed already imported, named ``deepy-rank<N>``; ``DEEPY_FORK_RANKS=0`` starts
    them fresh (what a GPU machine does)."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import atexit, os, sys, time\n"
        "preloaded = 'torch' in sys.modules and 'deepspeed' in sys.modules\n"
        "rank = os.environ['RANK']\n"
        "name = open('/proc/self/comm').read().strip()\n"
        "out = os.path.join(sys.argv[-1], 'rank' + rank)\n"
        "open(out, 'w').write(' '.join([os.environ['WORLD_SIZE'], sys.argv[1], __name__, sys.path[0], name,\n"
        "                               str(preloaded), str(sys.argv[0] == __file__)]))\n"
        "atexit.register(lambda: open(out + '.atexit', 'w').close())\n"
        "if os.environ.get('FAIL') == rank: sys.exit(3)\n"
        "time.sleep(60 if os.environ.get('FAIL') else 0)\n"
    )
    cmd = [sys.executable, "-m", "megatron.launcher.local_ranks", "--slots=0,1", "--master_port=29611",
           str(worker), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "DEEPY_FORK_RANKS": fork}
    assert not gpu_driver_present(), "a GPU machine never forks its ranks: this test is for CPU machines"
    assert subprocess.run(cmd, env=env, timeout=120).returncode == 0
    forked = fork == "1"
    for r in (0, 1):
        *seen, name, preloaded, argv0 = (tmp_path / f"rank{r}").read_text().split(" ")
        assert seen == ["2", f"--local_rank={r}", "__main__", str(tmp_path)] and argv0 == "True"
        assert (name == f"deepy-rank{r}") == forked and preloaded == str(forked), (name, preloaded)
        assert (tmp_path / f"rank{r}.atexit").exists()
    start = time.monotonic()
    failed = subprocess.run(cmd, env={**env, "FAIL": "1"}, timeout=120, capture_output=True, text=True)
    assert failed.returncode == 3 and time.monotonic() - start < 40, failed.stderr
    assert "exited with code 3; stopping the others" in failed.stderr


def test_ranks_are_forked_only_where_deepspeed_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NVIDIA/AMD driver, yet DeepSpeed on another accelerator (an XPU, an HPU): its runtime may be
    started by the import, so the workers start fresh."""
    import deepspeed.accelerator

    cpu_machine = not gpu_driver_present()
    assert local_ranks.fork_ranks_here({}) is cpu_machine and not local_ranks.fork_ranks_here({"DEEPY_FORK_RANKS": "0"})
    if cpu_machine:
        assert local_ranks.preload() is True  # DeepSpeed on the CPU here

    class Hpu:
        def device_name(self) -> str:
            return "hpu"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Hpu())
    assert local_ranks.preload() is False


def test_a_picked_port_lies_above_the_kernels_ephemeral_range_and_differs_by_process() -> None:
    """Outgoing connections take their local ports from the ephemeral range; a rendezvous port picked
    there could be taken before rank 0 listens. Two launches picking at once start apart."""
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ephemeral_range() == (low, high)
    picks = {free_port(pid) for pid in range(1000, 1008)}
    assert len(picks) == 8 and all(high < port <= 65535 and not port_in_use(port) for port in picks)
    # a port something listens on is skipped
    port = free_port(4242)
    with socket.socket() as sock:
        sock.bind(("", port))
        sock.listen()
        assert port_in_use(port) and free_port(4242) not in (port, None)


def test_a_chosen_free_port_is_kept_and_a_busy_one_is_a_config_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"master_port={busy} is already in use"):
            plan(num_gpus=2, master_port=busy)
    free = plan(num_gpus=2).master_port
    assert plan(num_gpus=2, master_port=free).master_port == free


def test_pdsh_across_hosts(hostfile: str) -> None:
    p = plan(hostfile=hostfile, master_addr="node1", master_port=29611)
    assert p.mode == "pdsh" and p.tools == ("pdsh",) and p.stop_route == "pdsh"
    assert p.hosts == ("node1", "node2") and p.world_size == 8
    assert value_after(p.argv, "--hostfile") == hostfile
    assert value_after(p.argv, "--master_addr") == "node1"
    assert value_after(p.argv, "--master_port") == "29611"  # another host's port: not checked here
    assert value_after(p.argv, "--launcher") == "pdsh"
    assert p.argv[-3:] == ["train.py", "--deepy_config", CONFIG]


def test_pdsh_include_exclude_filter_the_hostfile(hostfile: str) -> None:
    assert plan(hostfile=hostfile, include="node2:0,1", master_addr="node2").world_size == 2
    assert plan(hostfile=hostfile, exclude="node1", master_addr="node2").hosts == ("node2",)
    one = plan(hostfile=hostfile, include="node2", master_addr="node2")
    assert one.mode == "local" and value_after(one.argv, "--include") == "node2"
    with pytest.raises(ConfigError, match="host 'node9' is not in the resource pool"):
        plan(hostfile=hostfile, include="node9")


def test_a_loopback_first_host_cannot_serve_other_hosts(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\nnode2 slots=2\n")
    with pytest.raises(ConfigError, match="first host is 'localhost'"):
        plan(hostfile=str(path))
    assert plan(hostfile=str(path), master_addr="10.0.0.1").world_size == 4


def test_force_multi_on_one_host_uses_pdsh_to_localhost(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    p = plan(hostfile=str(path), force_multi=True, no_ssh_check=True)
    assert p.mode == "pdsh" and "--force_multi" in p.argv and "--no_ssh_check" in p.argv
    # rank 0 runs here: the runner is told the address, and the port is picked free here
    assert value_after(p.argv, "--master_addr") == "127.0.0.1" and not port_in_use(int(value_after(p.argv, "--master_port")))


def test_runner_flags_are_understood_by_deepspeeds_runner() -> None:
    from deepspeed.launcher.runner import parse_args

    cfg = config(hostfile="/etc/hosts.ds", num_nodes=2, num_gpus=8, force_multi=True, no_ssh_check=True)
    parsed = parse_args(runner_flags(cfg, cfg, 29600, "10.0.0.1") + ["train.py", "--deepy_config", "run/deepy_config.json"])
    assert parsed.hostfile == "/etc/hosts.ds"
    assert (parsed.num_nodes, parsed.num_gpus) == (2, 8)
    assert (parsed.master_addr, parsed.master_port) == ("10.0.0.1", 29600)
    assert parsed.launcher == "pdsh" and parsed.force_multi and parsed.no_ssh_check
    assert parsed.user_script == "train.py"
    assert parsed.user_args == ["--deepy_config", "run/deepy_config.json"]


# --- MPI ----------------------------------------------------------------------------------------
def mpi_inputs(active: dict[str, list[int]], environ: dict[str, str] | None = None, **values: Any) -> PlanInputs:
    args = config(**values)
    return PlanInputs(config=args, logging=args, master_port_given="master_port" in values, user_script="train.py",
                      config_path=CONFIG, environ=environ or {}, pool=active, active=active, python=PY)  # fmt: skip


def test_openmpi_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {**ROOT_OK, "WANDB_API_KEY": SECRET, "PYTHONPATH": "/opt/lib", "HOME": "/root"}
    p = plan(environ, launcher="openmpi", deepspeed_mpi=True, num_gpus=2)
    assert p.mode == "mpirun (openmpi)" and p.stop_route == "launcher" and p.tools == ("mpirun", "ompi_info")
    argv = p.argv
    assert argv[:7] == ["mpirun", "-n", "2", "--host", "localhost:2", "--bind-to", "none"]
    assert argv[-5:] == [PY, "-u", "train.py", "--deepy_config", CONFIG]
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    # names only: Open MPI sends the values to other hosts, and the command line never holds them
    assert {"WANDB_API_KEY", "PYTHONPATH", "MASTER_ADDR", "MASTER_PORT"} <= set(exported)
    assert "HOME" not in exported and all("=" not in name for name in exported)
    assert p.env["MASTER_ADDR"] == "127.0.0.1" and int(p.env["MASTER_PORT"]) == p.master_port
    assert not any(SECRET in a for a in argv)


def test_openmpi_across_hosts_places_ranks_per_host() -> None:
    argv = openmpi_argv(mpi_inputs({"n1": [0, 1], "n2": [0, 1, 2]}, launcher="openmpi"), {})
    assert value_after(argv, "-n") == "5" and value_after(argv, "--host") == "n1:2,n2:3"


def test_openmpi_as_root_needs_open_mpis_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(ConfigError, match="OMPI_ALLOW_RUN_AS_ROOT=1"):
        plan({}, launcher="openmpi", num_gpus=2)


def test_openmpi_as_root_without_mpirun_says_both_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: the dry run named the root consent, and once that was given, the missing mpirun."""
    import shutil

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(ConfigError) as refused:
        plan({}, launcher="openmpi", num_gpus=2)
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in refused.value.message
    assert "needs 'mpirun', 'ompi_info' on PATH, which is not installed here" in refused.value.message


@pytest.mark.parametrize("kind", ["mpich", "mvapich"])
def test_hydra_mpirun_for_mpich_and_mvapich(kind: str, hostfile: str) -> None:
    environ = {"WANDB_API_KEY": SECRET}
    p = plan(environ, launcher=kind, hostfile=hostfile, master_addr="node1", master_port=29612)
    argv = p.argv
    assert argv[:7] == ["mpirun", "-n", "8", "-ppn", "4", "-hosts", "node1,node2"]
    genv = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}
    assert genv["MASTER_ADDR"] == "node1" and genv["MASTER_PORT"] == "29612"
    assert ("MV2_ENABLE_AFFINITY" in genv) == (kind == "mvapich")
    assert not any(SECRET in a for a in argv)  # Hydra passes the environment on by itself
    assert p.stop_route == "launcher" and "mpirun" in p.tools


def test_hydra_needs_equal_ranks_per_host() -> None:
    with pytest.raises(ConfigError, match="same number of ranks on every host"):
        hydra_argv(mpi_inputs({"n1": [0, 1], "n2": [0]}, launcher="mpich"), "mpich", {})


def test_mpi_cannot_pick_slots(hostfile: str) -> None:
    with pytest.raises(ConfigError, match="cannot start ranks on chosen slots"):
        plan(ROOT_OK, launcher="openmpi", hostfile=hostfile, include="node1:1,2@node2", master_addr="node1")


# --- Slurm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, counts", [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]), ("4,2(x2)", [4, 2, 2])]
)
def test_slurm_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


def test_srun_starts_one_task_per_rank() -> None:
    pool = {"n1": [0, 1], "n2": [0, 1]}
    worker = [PY, "-u", "train.py", "--deepy_config", CONFIG]
    argv = srun_argv(config(launcher="slurm", comment="nightly run", account="lm"), pool, pool, worker)
    assert argv == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
                    "--comment=nightly run", "--account=lm", "--export=ALL", *worker]  # fmt: skip
    # a narrowed allocation names its hosts; uneven task counts leave the placement to Slurm
    narrowed = srun_argv(config(launcher="slurm"), {"n2": [0, 1]}, pool, worker)
    assert "--nodelist=n2" in narrowed and "--nodes=1" in narrowed
    uneven = srun_argv(config(launcher="slurm"), {"n1": [0, 1], "n2": [0]}, {"n1": [0, 1], "n2": [0]}, worker)
    assert "--ntasks=3" in uneven and not any(a.startswith("--ntasks-per-node") for a in uneven)
    with pytest.raises(ConfigError, match="srun places tasks by count"):
        srun_argv(config(launcher="slurm"), {"n1": [1]}, pool, worker)


def test_slurm_needs_an_allocation() -> None:
    with pytest.raises(ConfigError, match="inside a Slurm allocation"):
        plan({}, launcher="slurm")


def test_in_place_only_for_a_task_of_a_job_step() -> None:
    task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    p = plan(task, deepspeed_slurm=True)
    assert p.mode == "in-place (slurm)" and p.in_place and p.world_size == 8
    assert p.argv == [PY, "-u", "train.py", "--deepy_config", CONFIG]
    # the batch script has SLURM_PROCID=0 and SLURM_NTASKS too, but is no task: it must launch
    batch = {k: v for k, v in task.items() if k != "SLURM_STEP_ID"}
    assert started_by_scheduler(batch, slurm=True, mpi=False) is None
    # without the option, an allocation's variables alone do not change how deepy launches
    assert plan(task).mode == "local"


def test_in_place_when_deepy_itself_is_an_mpirun_rank() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert plan(env, deepspeed_mpi=True).mode == "in-place (openmpi)"
    # RANK already set means DeepSpeed's launcher started us: never launch in place
    assert plan({**env, "RANK": "0"}, deepspeed_mpi=True).mode == "local"


# --- tools, exit codes, environment ----------------------------------------------------------------
def test_missing_tool_is_a_config_error() -> None:
    p = LaunchPlan(argv=["x"], mode="srun", world_size=2, config_path=CONFIG, tools=("no-such-launcher-tool-xyz",))
    with pytest.raises(ConfigError, match="launcher='slurm' .* needs 'no-such-launcher-tool-xyz'"):
        check_tools(p, config(launcher="slurm"))
    check_tools(LaunchPlan(argv=["x"], mode="local", world_size=1, config_path=CONFIG, tools=(sys.executable,)),
                config())  # fmt: skip


def test_exit_codes_read_like_a_shell() -> None:
    assert exit_code(0) == 0 and exit_code(3) == 3
    assert exit_code(-9) == 137 and exit_code(-15) == 143


def test_user_environment_is_added_to_never_replaced() -> None:
    env = worker_environment({"PYTHONPATH": "/opt/lib:/opt/more", "PDSH_SSH_ARGS_APPEND": "-p 2222 -i key"},
                             {"MASTER_PORT": "29613"})  # fmt: skip
    first, rest = env["PYTHONPATH"].split(":", 1)
    assert os.path.isfile(os.path.join(first, "megatron", "initialize.py"))
    assert rest == "/opt/lib:/opt/more"
    assert env["PDSH_SSH_ARGS_APPEND"] == "-p 2222 -i key" and env["MASTER_PORT"] == "29613"
    assert worker_environment(env)["PYTHONPATH"] == env["PYTHONPATH"]  # added once


def test_secrets_stay_off_every_command_line(hostfile: str) -> None:
    environ = {**ROOT_OK, "WANDB_API_KEY": SECRET}
    slurm = srun_argv(config(launcher="slurm"), {"n1": [0]}, {"n1": [0]}, [PY, "train.py"])
    plans = [plan(environ, num_gpus=2), plan(environ, launcher="openmpi", num_gpus=2),
             plan(environ, hostfile=hostfile, master_addr="node1"), plan(environ, launcher="mpich", num_gpus=2)]  # fmt: skip
    for argv in [slurm, *(p.argv for p in plans)]:
        assert not any(SECRET in a for a in argv), argv
    for p in plans:
        assert SECRET not in str(p.env)  # inherited from deepy's own environment, never copied


# --- stop requests ---------------------------------------------------------------------------------
RANK = [PY, "-u", "/w/train.py", "--local_rank=1", "--deepy_config", CONFIG]
NODE_LAUNCHER = [PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--node_rank=0",
                 "--master_addr=h", "--master_port=1", "/w/train.py", "--deepy_config", CONFIG]  # fmt: skip


def test_ranks_are_told_apart_from_deepspeeds_launchers() -> None:
    assert is_rank_cmdline(RANK, CONFIG)
    assert is_rank_cmdline([PY, "-u", "train.py", "--deepy_config", CONFIG], CONFIG)  # srun/mpirun task
    assert not is_rank_cmdline(NODE_LAUNCHER, CONFIG)
    assert not is_rank_cmdline(plan(num_gpus=2).argv, CONFIG)  # deepy's own per-node launcher
    assert not is_rank_cmdline(RANK[:-1] + ["other/deepy_config.json"], CONFIG)


def test_pdsh_stop_signals_ranks_only() -> None:
    p = LaunchPlan(argv=[], mode="pdsh", world_size=2, config_path=CONFIG, hosts=("n1", "n2"), stop_route="pdsh")
    argv = pdsh_stop_command(p, 10)
    assert argv[:6] == ["pdsh", "-S", "-R", "ssh", "-w", "n1,n2"] and argv[6].startswith("pkill -USR1 -f -- ")
    pattern = argv[6].split(" -- ", 1)[1].strip("'")
    assert re.search(pattern, " ".join(RANK))
    assert not re.search(pattern, " ".join(NODE_LAUNCHER))
    assert not re.search(pattern, f"bash -c {argv[6]}")  # the remote shell running pkill
    assert not re.search(pattern, " ".join(RANK) + ".bak")


# --- environment mapping (worker side) -------------------------------------------------------------
def test_deepspeed_launcher_variables_pass_through() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29555"}
    assert distributed_env(env, master_addr="ignored", master_port=1) == env


def test_slurm_variables_are_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1"}
    mapped = distributed_env(env, master_port=29600, prefer_slurm=True)
    assert mapped["RANK"] == "5" and mapped["LOCAL_RANK"] == "1" and mapped["WORLD_SIZE"] == "8"
    assert mapped["MASTER_PORT"] == "29600"
    assert mapped["MASTER_ADDR"] == "gpu07"
    # what deepy exports to the job step wins over the node list
    assert distributed_env({**env, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4000"})["MASTER_ADDR"] == "10.0.0.7"


@pytest.mark.parametrize(
    "nodelist, first",
    [("node[3-5,9]", "node3"), ("a1,a2", "a1"), ("gpu[07-08],cpu[1-2]", "gpu07"), ("solo", "solo"), ("r[2]x", "r2x")],
)
def test_first_slurm_host(nodelist: str, first: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the parser answers
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, ("2", "0", "4")),
        ({"PMI_RANK": "3", "MPI_LOCALRANKID": "1", "PMI_SIZE": "4"}, ("3", "1", "4")),
        ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}, ("1", "1", "2")),
    ],
)
def test_mpi_variables_are_mapped(env: dict[str, str], expected: tuple[str, str, str]) -> None:
    mapped = distributed_env(env, master_addr="head", master_port=29601)
    assert (mapped["RANK"], mapped["LOCAL_RANK"], mapped["WORLD_SIZE"]) == expected
    assert mapped["MASTER_ADDR"] == "head"


def test_mpi_without_rendezvous_address_is_an_error() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(ConfigError, match="set master_addr"):
        distributed_env(env)


def test_mpirun_inside_slurm_prefers_the_inner_mpi_ranks() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    assert distributed_env(env, master_addr="h")["RANK"] == "3"
    assert distributed_env(env, master_addr="h", prefer_slurm=True)["RANK"] == "0"


def test_a_lone_process_is_rank_zero_of_one() -> None:
    mapped = distributed_env({}, master_port=29602)
    assert mapped == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29602"}


# --- resource pool: Deepy's copy agrees with DeepSpeed's runner -------------------------------------
POOL_CASES = [
    ("", "", -1, -1),
    ("", "", 2, -1),
    ("", "", 2, 1),
    ("", "", -1, 3),
    ("a:0,1@c", "", -1, -1),
    ("b", "", -1, -1),
    ("", "b", -1, -1),
    ("", "a:1,2@c:0", -1, -1),
]


@pytest.mark.parametrize("include, exclude, num_nodes, num_gpus", POOL_CASES)
def test_resources_match_deepspeeds_runner(include: str, exclude: str, num_nodes: int, num_gpus: int) -> None:
    from deepspeed.launcher import runner

    from megatron.launcher.resources import apply_counts, filter_pool, parse_hostfile

    lines = ["a slots=4\n", "# comment\n", "\n", "b slots=2\n", "c slots=2\n"]
    ours = apply_counts(filter_pool(parse_hostfile(lines), include, exclude), num_nodes, num_gpus)
    pool = runner._parse_hostfile(lines)
    theirs = runner.apply_num_nodes_and_gpus(runner.parse_inclusion_exclusion(pool, include, exclude), num_nodes, num_gpus)
    assert ours == {host: list(slots) for host, slots in theirs.items()}


@pytest.mark.parametrize(
    "lines, include, needle",
    [
        (["a slots=2\n", "a slots=2\n"], "", "listed twice"),
        (["a slot=2\n"], "", "line 1"),
        (["# only a comment\n"], "", "lists no hosts"),
        (["a slots=2\n"], "a:5", "has no slot 5"),
        (["a slots=2\n"], "z", "host 'z' is not in the resource pool"),
    ],
)
def test_resource_mistakes(lines: list[str], include: str, needle: str) -> None:
    from megatron.launcher.resources import filter_pool, parse_hostfile

    with pytest.raises(ConfigError, match=needle):
        filter_pool(parse_hostfile(lines), include)


def test_removed_deepspeed_keys_match_the_installed_deepspeed() -> None:
    from deepspeed.runtime import config as ds_config

    from megatron.neox_arguments.deepspeed_split import REMOVED_DEEPSPEED_KEYS

    assert set(REMOVED_DEEPSPEED_KEYS) == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)


def test_every_launcher_kind_is_registered() -> None:
    from typing import get_args

    from megatron.launcher.config import LauncherName

    assert set(LAUNCHERS) == set(get_args(LauncherName)) == set(get_args(NeoXArgs.model_fields["launcher"].annotation))


def test_counting_ranks_does_not_import_deepspeed_and_checking_prints_nothing(tmp_path: Any) -> None:
    """World size and launch planning are DeepSpeed-free; the full check (which runs DeepSpeed's own
    config parser on the fp16/bf16/ZeRO blocks) prints nothing of DeepSpeed's on stdout."""
    import subprocess

    code = (
        "import sys\n"
        "from megatron.neox_arguments.arguments import NeoXArgs\n"
        "from megatron.neox_arguments.resolved import ResolvedConfig\n"
        "from megatron.neox_arguments import detect_world_size, finalize\n"
        "args = NeoXArgs(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8, lr=0.1,\n"
        "                train_micro_batch_size_per_gpu=1, train_iters=1, use_dummy_dataset=True, num_gpus=2,\n"
        "                tokenizer_type='CharLevelTokenizer')\n"
        "world = detect_world_size(args)\n"
        "from megatron.launcher import plan_launch\n"
        "plan_launch(args, 'train.py', 'c.json', {}, logging=args)\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'\n"
        "finalize(ResolvedConfig(args=args), world)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
