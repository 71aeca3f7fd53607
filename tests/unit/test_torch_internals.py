"""Every private torch name megatron/torch_internals.py touches still exists with the shape that
module relies on (pinned torch 2.13). A torch upgrade that moves one fails here first."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron import torch_internals


def test_flatten_and_unflatten_round_trip_mixed_shapes() -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0]), torch.arange(4.0).reshape(2, 2, 1)]
    flat = torch_internals.flatten_dense_tensors(tensors)
    assert flat.shape == (11,)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))  # the direct computation
    back = torch_internals.unflatten_dense_tensors(flat * 2, tensors)
    assert [b.shape for b in back] == [t.shape for t in tensors]
    assert all(torch.equal(b, 2 * t) for b, t in zip(back, tensors))


def test_tensor_version_counts_in_place_writes() -> None:
    t = torch.zeros(3)
    before = torch_internals.tensor_version(t)
    t.copy_(torch.ones(3))  # what a checkpoint load does to a buffer
    assert torch_internals.tensor_version(t) == before + 1
    t.add_(1)
    assert torch_internals.tensor_version(t) == before + 2
    assert torch_internals.tensor_version(t + 1) == 0  # a new tensor starts at 0



def test_lerp_all_is_a_lerp_of_each_pair_in_place() -> None:
    """The weight average's update: ``a + w (b - a)`` per element, bit-equal to a ``lerp_`` of each pair (the
    fp32 average of a run without masters stays what it was), an empty tensor (a rank holding no fragment of a
    parameter) included."""
    torch.manual_seed(0)
    averages = [torch.randn(3, 4), torch.randn(0), torch.randn(5)]
    ends = [torch.randn(3, 4), torch.randn(0), torch.randn(5)]
    expected = [a.clone().lerp_(b, 0.3) for a, b in zip(averages, ends)]
    direct = [a + 0.3 * (b - a) for a, b in zip(averages, ends)]
    storages = [a.data_ptr() for a in averages]
    torch_internals.lerp_all_(averages, ends, 0.3)
    assert [a.data_ptr() for a in averages] == storages  # in place
    assert all(torch.equal(a, e) for a, e in zip(averages, expected))
    assert all(torch.allclose(a, d, atol=1e-6) for a, d in zip(averages, direct))

def test_mkldnn_fp16_question_is_the_one_deepspeeds_cpu_accelerator_asks() -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert "torch.ops.mkldnn._is_mkldnn_fp16_supported()" in inspect.getsource(CPU_Accelerator)
    try:
        answer = torch_internals.mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):  # what Device.detect reads as "no"
        pytest.fail("torch.ops.mkldnn._is_mkldnn_fp16_supported is gone or fails on this CPU build")
    assert isinstance(answer, bool)


def test_cuda_memory_history_entry_points_keep_their_parameters() -> None:
    """No GPU here: the snapshot calls themselves run in GPU jobs; the names and keywords are pinned."""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(record)
    assert "None" in str(record["enabled"].annotation)  # enabled=None is how recording stops
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[0] == "filename"


def test_compile_counts_count_graphs_and_breaks() -> None:
    from megatron.torch_internals import compile_counts, reset_compile_counts

    reset_compile_counts()
    assert compile_counts() == (0, 0)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print("", end="")  # a graph break: two graphs
        return y + 1

    torch.compile(f, backend="eager")(torch.ones(2))
    assert compile_counts() == (2, 1)
    reset_compile_counts()
