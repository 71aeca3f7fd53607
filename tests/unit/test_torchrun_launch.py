"""``launcher: torchrun``'s commands, and the pieces a worker started by torchrun (or DeepSpeed's runner) uses to
resolve the config itself and to agree with the other ranks. Nothing is started here; tests/e2e/test_torchrun.py,
test_slurm.py and test_pdsh.py run the same commands for real."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from megatron.app.external_launch import (
    ExternalLaunch,
    RankRecord,
    code_differences,
    code_fingerprint,
    config_differences,
    difference_message,
    strip_launcher_flags,
)
from megatron.errors import ConfigError
from megatron.launcher import LaunchPlan, plan_launch
from megatron.launcher.processes import is_rank_cmdline
from megatron.launcher.run import pdsh_stop_command
from megatron.neox_arguments.arguments import NeoXArgs

CONFIG = "runs/20260101-000000/deepy_config.json"
PY = "/usr/bin/python3"


def plan(devices: int = 1, **values: Any) -> LaunchPlan:
    args = NeoXArgs(launcher="torchrun", **values)
    return plan_launch(args, "train.py", CONFIG, {}, lambda: devices, python=PY,
                       provenance={key: "cli" for key in values}, logging=args)


def test_on_this_machine_one_agent_starts_every_rank_and_restarts_them() -> None:
    p = plan(num_gpus=4, max_restarts=2)
    assert p.mode == "local torchrun" and p.world_size == 4 and p.restarts_itself and p.stop_route == "ranks"
    assert p.argv[:4] == [PY, "-u", "-m", "torch.distributed.run"]
    assert "--nnodes=1" in p.argv and "--nproc-per-node=4" in p.argv and "--rdzv-backend=c10d" in p.argv
    assert f"--rdzv-endpoint=127.0.0.1:{p.master_port}" in p.argv and "--max-restarts=2" in p.argv
    assert p.argv[-3:] == ["train.py", "--deepy_config", CONFIG]
    # torchrun's own parser takes the command (its flags before the script, the script's after)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(p.argv[4:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.max_restarts) == ("1", "4", 2)
    assert parsed.training_script == "train.py" and parsed.training_script_args == ["--deepy_config", CONFIG]


def test_across_a_hostfile_pdsh_starts_an_agent_per_host_and_stops_only_the_ranks(tmp_path: Path) -> None:
    hosts = tmp_path / "hostfile"
    hosts.write_text("node1 slots=8\nnode2 slots=8\n")
    p = plan(hostfile=str(hosts), master_addr="node1", master_port=29611)
    assert p.mode == "pdsh + torchrun" and p.hosts == ("node1", "node2") and p.world_size == 16
    assert p.argv[:6] == ["pdsh", "-S", "-R", "ssh", "-w", "node1,node2"]
    remote = shlex.split(p.argv[-1].split(" && ")[-1])
    assert "--nnodes=2" in remote and "--nproc-per-node=8" in remote and "--rdzv-endpoint=node1:29611" in remote
    pattern = shlex.split(pdsh_stop_command(p, 10)[-1])[-1]
    worker = f"{PY} -u train.py --deepy_config {CONFIG}"
    agent = " ".join(remote)
    assert re.search(pattern, worker) and not re.search(pattern, agent)
    # the pkill's own shell (whose command line holds the pattern) does not match it either
    assert not re.search(pattern, pdsh_stop_command(p, 10)[-1])
    unequal = tmp_path / "unequal"
    unequal.write_text("node1 slots=8\nnode2 slots=4\n")
    with pytest.raises(ConfigError, match="same number of workers on every node"):
        plan(hostfile=str(unequal), master_addr="node1")


def test_a_torchrun_agent_is_not_a_rank() -> None:
    agent = [PY, "-u", "-m", "torch.distributed.run", "--nnodes=1", "train.py", "--deepy_config", CONFIG]
    wrapped = [PY, "-u", "-m", "megatron.launcher.torchrun", "--nnodes=1", "train.py", "--deepy_config", CONFIG]
    assert not is_rank_cmdline(agent, CONFIG) and not is_rank_cmdline(wrapped, CONFIG)
    assert is_rank_cmdline([PY, "-u", "train.py", "--deepy_config", CONFIG], CONFIG)


def test_a_worker_knows_its_launcher_from_the_environment() -> None:
    torchrun = ExternalLaunch.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1",
                                            "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert torchrun is not None and torchrun.launcher == "torchrun" and torchrun.nodes == 4
    assert (torchrun.rank, torchrun.local_rank, torchrun.restart, torchrun.max_restarts) == (3, 1, 1, 3)
    assert torchrun.rendezvous_id == "job7"
    deepspeed = ExternalLaunch.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"})
    assert deepspeed is not None and deepspeed.launcher == "DeepSpeed's launcher" and deepspeed.nodes == 2
    assert ExternalLaunch.from_environ({"WORLD_SIZE": "2"}) is None
    assert strip_launcher_flags(["a.yml", "x=1", "--local_rank=0"]) == ["a.yml", "x=1"]
    assert strip_launcher_flags(["a.yml", "--local_rank", "3", "y=2"]) == ["a.yml", "y=2"]


def test_a_difference_is_named_by_key_with_both_sources_and_by_file() -> None:
    ours = [{"args": {"lr": 0.1, "seed": 1}, "deepspeed": {}}, {"megatron/a.py": "1", "torch": "2.13.0"},
            {"lr": "a.yml:3"}]
    theirs = [{"args": {"lr": 0.2, "seed": 1}, "deepspeed": {}}, {"megatron/a.py": "2", "torch": "2.13.0"},
              {"lr": "cli"}]
    assert config_differences(ours[0], theirs[0]) == ["lr"]
    assert code_differences(ours[1], theirs[1]) == ["megatron/a.py"]
    first, odd = RankRecord(0, "h0", "c0", "k0", None), RankRecord(5, "h5", "c5", "k5", None)
    text = difference_message(first, odd, ours, theirs, "torchrun")
    assert "megatron/a.py differs between rank 0 (host h0) and rank 5 (host h5)" in text
    assert "lr=0.1 on rank 0 (host h0; a.yml:3) but 0.2 on rank 5 (host h5; cli)" in text
    assert "seed" not in text


def test_the_code_fingerprint_names_every_source_file_and_library(tmp_path: Path) -> None:
    found = code_fingerprint("train.py")
    assert "megatron/app/external_launch.py" in found and "train.py" in found and "torch" in found
    assert len({v for k, v in found.items() if k.endswith(".py")}) > 100  # one digest per file, not one in all


def test_the_dry_run_says_torchrun_restarts_and_shows_its_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.app.deepy import main

    (tmp_path / "model.yml").write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nmax_position_embeddings: 32\n"
        "train_batch_size: 8\ntrain_iters: 10\nlr: 0.001\nuse_dummy_dataset: true\ntokenizer_type: CharLevelTokenizer\n")
    monkeypatch.chdir(tmp_path)
    train = str(Path(__file__).resolve().parents[2] / "train.py")
    assert main(["--dry-run", train, "model.yml", "launcher=torchrun", "num_gpus=2", "max_restarts=2"]) == 0
    out = capsys.readouterr().out
    assert "restarts: torchrun's agents restart the ranks up to 2 time(s)" in out
    assert "Launch: 2 rank(s) via local torchrun:" in out and "--max-restarts=2" in out
