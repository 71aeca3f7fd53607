"""What would break or be slow on NVIDIA GPUs, shown on the CPU: each test names the mechanism
(issue 33) and fails on the code before the fix."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist


class _Stop(Exception):
    """Raised by a stand-in collective once it has seen its tensor."""


def _pretend_nccl(monkeypatch: pytest.MonkeyPatch, device: str = "meta") -> None:
    """torch.distributed says NCCL and DeepSpeed's accelerator names ``device`` as the current GPU."""
    import deepspeed.accelerator

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    fake = types.SimpleNamespace(current_device_name=lambda: device)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)


# --- collectives: the tensor lives where the backend moves memory -----------------------------------
def test_tensor_parallel_statistics_are_reduced_on_the_collective_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """log_param_norm & co. with tp > 1 all-reduce a table over the tensor-parallel group: under NCCL
    it must be a GPU tensor (a CPU float64 tensor is refused at the first log step)."""
    from megatron.logging.stats import StatsCollector
    from megatron.mpu import topology

    _pretend_nccl(monkeypatch)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(topology, "get_tensor_model_parallel_group", lambda: None)
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        seen.append(tensor.device)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    collector = StatsCollector.__new__(StatsCollector)
    collector.named = [("w", torch.nn.Parameter(torch.ones(2)))]
    with pytest.raises(_Stop):
        collector._reduce({"w": [1.0, 0.0, 2.0]})
    assert seen == [torch.device("meta")]


# --- which GPUs a rank gets -------------------------------------------------------------------------
def _local_launch(**keys: object) -> object:
    from megatron.neox_arguments.arguments import NeoXArgs

    return NeoXArgs(**keys)


@pytest.mark.parametrize("num_gpus, slots", [(None, [4, 5]), (1, [4])])
def test_a_local_launch_keeps_the_visible_devices(num_gpus: int | None, slots: list[int]) -> None:
    """With CUDA_VISIBLE_DEVICES=4,5 (two GPUs to torch) the ranks run on GPUs 4 and 5, not 0 and 1:
    the per-node launcher writes the slots into each rank's CUDA_VISIBLE_DEVICES."""
    from megatron.launcher import local_ranks
    from megatron.launcher.resources import active_resources

    environ = {"CUDA_VISIBLE_DEVICES": "4,5"}
    active = active_resources(_local_launch(num_gpus=num_gpus), environ, lambda: 2)
    assert active == {"localhost": slots}
    envs = [local_ranks.rank_environment(environ, slots, r, "127.0.0.1", 29500) for r in range(len(slots))]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [",".join(map(str, slots))] * len(slots)
    assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(len(slots))]


def test_devices_named_by_uuid_are_handed_on_by_name() -> None:
    from megatron.launcher import local_ranks

    environ = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
    env = local_ranks.rank_environment(environ, [0, 1], 1, "127.0.0.1", 29500)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"


@pytest.mark.parametrize("visible, local_id, expected", [("3", "3", "0"), ("2,3", "3", "1"), ("0,1,2,3", "3", "3"),
                                                         ("", "3", "3")])
def test_a_slurm_task_bound_to_its_own_gpu_is_local_rank_zero(visible: str, local_id: str, expected: str) -> None:
    """srun --gpus-per-task=1 shows task 3 of a node one GPU; DeepSpeed's engine calls
    set_device(LOCAL_RANK), so LOCAL_RANK must index what the task sees."""
    from megatron.launcher.environment import distributed_env

    env = {"SLURM_PROCID": "11", "SLURM_LOCALID": local_id, "SLURM_NTASKS": "16", "MASTER_ADDR": "10.0.0.1",
           "CUDA_VISIBLE_DEVICES": visible}
    assert distributed_env(env, prefer_slurm=True)["LOCAL_RANK"] == expected


# --- dropout streams: each pipeline stage and context-parallel piece draws its own masks -----------
def _masks_at(monkeypatch: pytest.MonkeyPatch, tp: int, pp: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first dropout mask of the default stream and of the tensor-parallel stream on a rank at (tp, pp, cp)."""
    from megatron.mpu import random as mpu_random

    for name, value in (("get_tensor_model_parallel_rank", tp), ("get_pipe_parallel_rank", pp),
                        ("get_context_parallel_rank", cp)):
        monkeypatch.setattr(mpu_random, name, lambda value=value: value, raising=False)
    mpu_random.model_parallel_manual_seed(1234)
    replicated = torch.rand(64) < 0.5
    with mpu_random.tensor_parallel_rng():
        sharded = torch.rand(64) < 0.5
    return replicated, sharded


def test_each_stage_and_context_piece_draws_its_own_dropout_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    state = torch.get_rng_state()
    try:
        first = _masks_at(monkeypatch, 0, 0, 0)
        assert all(torch.equal(a, b) for a, b in zip(first, _masks_at(monkeypatch, 0, 0, 0)))  # reproducible
        for coords in ((0, 1, 0), (0, 0, 1), (0, 1, 1)):  # another stage, context piece, or both
            other = _masks_at(monkeypatch, *coords)
            assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1]), coords
        # tensor-parallel ranks of one stage agree on replicated activations, differ on their shards
        tp1 = _masks_at(monkeypatch, 1, 0, 0)
        assert torch.equal(first[0], tp1[0]) and not torch.equal(first[1], tp1[1])
    finally:
        from megatron.mpu.random import get_rng_tracker

        get_rng_tracker().reset()  # no seeded tracker left behind for other tests of this process
        torch.set_rng_state(state)


def test_stream_seeds_of_a_grid_are_all_different() -> None:
    from megatron.mpu.random import stream_seeds

    grid = [stream_seeds(7, tp, pp, cp) for tp in range(8) for pp in range(16) for cp in range(8)]
    default = {(pp, cp): stream_seeds(7, 0, pp, cp)[0] for pp in range(16) for cp in range(8)}
    assert len(set(default.values())) == len(default)
    assert len({s for _, s in grid}) == len(grid) and not {s for _, s in grid} & set(default.values())
    assert stream_seeds(7, 0) == (7, 7 + 2718)  # one stage, no context parallelism: as before
