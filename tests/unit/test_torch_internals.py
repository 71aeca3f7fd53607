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


FAKE_WORLD = """
import sys

import pytest
import torch
import torch.distributed as dist

from megatron import torch_internals

hook = sys.excepthook
with torch_internals.fake_process_group(517, 1024):
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (517, 1024, "fake")
    group = dist.new_group(ranks=[516, 517])
    assert dist.get_world_size(group) == 2 and dist.get_rank(group) == 1
    ones = torch.ones(3)
    dist.all_reduce(ones)
    assert torch.equal(ones, torch.ones(3))  # nothing moved
    dist.all_reduce(torch.empty(4, device="meta"), group=group)
assert not dist.is_initialized() and sys.excepthook is hook
with pytest.raises(RuntimeError, match="already exists"):
    with torch_internals.fake_process_group(0, 2):
        with torch_internals.fake_process_group(1, 2):
            pass
assert not dist.is_initialized()
print("ok")
"""


def test_fake_process_group_makes_this_process_any_rank_and_cleans_up() -> None:
    """torch's ``fake`` backend (registered by ``torch.testing._internal.distributed.fake_pg``): rank 517 of 1,024,
    groups of any ranks, collectives that return at once (also on meta tensors); afterwards no process group and
    the traceback hook as it was (``init_process_group`` prefixes tracebacks with the rank). In a process of its
    own: a pytest worker may hold the single-rank gloo world other tests share (tests/single_rank.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", FAKE_WORLD], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_meta_tensors_stay_on_meta_through_module_to() -> None:
    """DeepSpeed's PipelineModule calls ``self.to(<accelerator device>)`` on the stage it built; a meta stage fails
    there without the mode, stays on meta with it, and real tensors still move."""
    with torch.device("meta"):
        module = torch.nn.Linear(3, 2)
    with pytest.raises(NotImplementedError):
        module.to("cpu")
    with torch_internals.meta_tensors_stay_on_meta():
        module.to("cpu")
        moved = torch.ones(2, dtype=torch.float64).to(torch.float32)
    assert {p.device.type for p in module.parameters()} == {"meta"}
    assert moved.dtype == torch.float32 and moved.device.type == "cpu"


def test_a_shared_cpu_storage_opens_on_the_same_memory() -> None:
    """The weight server's CPU handle (``serve_model_weights``): a parameter's storage moved into shared memory keeps
    its values, and the storage opened from the handle sees later in-place writes."""
    weight = torch.nn.Linear(3, 2).weight
    before = weight.detach().clone()
    manager, handle, size = torch_internals.share_cpu_storage(weight.untyped_storage())
    assert torch.equal(weight.detach(), before) and size == weight.numel() * weight.element_size()
    opened = torch.empty(0).set_(torch_internals.open_shared_cpu_storage(manager, handle, size), 0, weight.shape,
                                 weight.stride())
    with torch.no_grad():
        weight.mul_(3)
    assert torch.equal(opened, weight.detach())
    assert callable(getattr(torch.UntypedStorage, "_share_cuda_"))  # the GPU route, which needs a GPU to call
