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
