"""Launch commands for each launcher kind, and the Slurm/MPI environment mapping (nothing is run)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.launcher.command import LaunchPlan, plan_launch
from megatron.launcher.environment import distributed_env, first_slurm_host
from megatron.launcher.kinds import LAUNCHERS
from megatron.launcher.run import check_backend, exit_code, worker_environment
from megatron.neox_arguments.arguments import NeoXArgs

CONFIG = "runs/20260101-000000/deepy_config.json"
ONE_NODE = {"localhost": [0, 1]}
TWO_NODES = {"node1": [0, 1, 2, 3], "node2": [0, 1, 2, 3]}


def plan(environ: dict[str, str] | None = None, active: Any = None, **values: Any) -> LaunchPlan:
    return plan_launch(NeoXArgs(**values), "train.py", CONFIG, environ or {}, active or ONE_NODE,
                       python="/usr/bin/python3")


def test_local_run_goes_through_deepspeeds_runner_with_the_config_path() -> None:
    p = plan(num_gpus=2, master_port=29700)
    assert p.mode == "runner" and not p.multi_node and p.tool is None
    assert p.argv == [
        "/usr/bin/python3", "-u", "-m", "deepspeed.launcher.runner",
        "--num_gpus", "2", "--master_port", "29700", "--launcher", "pdsh", "--log_level", "warning",
        "train.py", "--deepy_config", CONFIG,
    ]
    # no config blob on the command line: every argument is short and readable
    assert max(len(a) for a in p.argv) < 80


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_each_multi_node_launcher_kind(kind: str) -> None:
    p = plan(active=TWO_NODES, hostfile="hosts", launcher=kind, master_addr="node1")
    assert p.mode == "runner" and p.multi_node
    assert p.tool == LAUNCHERS[kind].tool
    argv = p.argv
    assert argv[argv.index("--launcher") + 1] == kind
    assert argv[argv.index("--hostfile") + 1] == "hosts"
    assert argv[argv.index("--master_addr") + 1] == "node1"
    assert argv[-3:] == ["train.py", "--deepy_config", CONFIG]


def test_force_multi_on_one_node_needs_the_backend() -> None:
    p = plan(launcher="openmpi", force_multi=True)
    assert p.multi_node and p.tool == "ompi_info" and "--force_multi" in p.argv


def test_slurm_comment_and_account_reach_srun() -> None:
    p = plan(active=TWO_NODES, hostfile="hosts", launcher="slurm", comment="nightly", account="lm")
    argv = p.argv
    assert argv[argv.index("--launcher_args") + 1] == "--comment=nightly --account=lm"


def test_in_place_when_deepy_itself_is_an_srun_task() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    p = plan(env, deepspeed_slurm=True)
    assert p.mode == "in-place (slurm)"
    assert p.argv == ["/usr/bin/python3", "-u", "train.py", "--deepy_config", CONFIG]
    # without the option, an allocation's variables alone do not change how deepy launches
    assert plan(env).mode == "runner"


def test_in_place_when_deepy_itself_is_an_mpirun_rank() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert plan(env, deepspeed_mpi=True).mode == "in-place (openmpi)"
    # RANK already set means DeepSpeed's launcher started us: never launch in place
    assert plan({**env, "RANK": "0"}, deepspeed_mpi=True).mode == "runner"


def test_missing_backend_tool_is_a_config_error() -> None:
    p = LaunchPlan(argv=["x"], mode="runner", multi_node=True, tool="no-such-launcher-tool-xyz")
    with pytest.raises(ConfigError, match="launcher='slurm' needs 'no-such-launcher-tool-xyz'"):
        check_backend(p, NeoXArgs(launcher="slurm"))
    check_backend(LaunchPlan(argv=["x"], mode="runner", tool=sys.executable), NeoXArgs())


def test_exit_codes_read_like_a_shell() -> None:
    assert exit_code(0) == 0 and exit_code(3) == 3
    assert exit_code(-9) == 137 and exit_code(-15) == 143


def test_workers_can_import_megatron_from_anywhere() -> None:
    env = worker_environment({"PYTHONPATH": "/opt/lib"})
    first, rest = env["PYTHONPATH"].split(":", 1)
    assert os.path.isfile(os.path.join(first, "megatron", "initialize.py"))
    assert rest == "/opt/lib"
    assert worker_environment(env)["PYTHONPATH"] == env["PYTHONPATH"]  # added once


# --- environment mapping ---------------------------------------------------------------------------
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


def test_checking_a_config_does_not_import_deepspeed(tmp_path: Any) -> None:
    import subprocess

    code = (
        "import sys\n"
        "from megatron.neox_arguments.arguments import NeoXArgs\n"
        "from megatron.neox_arguments.resolved import ResolvedConfig\n"
        "from megatron.neox_arguments import detect_world_size, finalize\n"
        "args = NeoXArgs(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8, lr=0.1,\n"
        "                train_micro_batch_size_per_gpu=1, train_iters=1, use_dummy_dataset=True, num_gpus=2)\n"
        "finalize(ResolvedConfig(args=args), detect_world_size(args))\n"
        "from megatron.launcher import plan_launch\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
