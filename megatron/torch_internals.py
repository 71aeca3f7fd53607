"""Every place Deepy reaches past torch's public API, in one module.

torch (pinned: 2.13) keeps a few things the trainer needs behind underscored names. Each touch below
says why no public alternative serves; ``tests/unit/test_torch_internals.py`` checks that every name
used here still exists with the shape relied on, so a torch upgrade that moves one fails there first.
``tests/unit/test_private_api_boundary.py`` keeps every other module of the project off private torch
(and DeepSpeed) names.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` into one flat buffer, so a bucket of gradients is reduced in one
    collective. torch's own helper (``torch._utils``; DDP and DeepSpeed use it too) already handles
    mixed shapes and the one-tensor case without copying."""
    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors``: the inverse of :func:`flatten_dense_tensors`."""
    return tuple(_unflatten_dense_tensors(flat, tensors))


def tensor_version(tensor: torch.Tensor) -> int:
    """The counter autograd bumps on every in-place write to ``tensor`` (``Tensor._version``).

    A cache keyed by it notices a buffer overwritten in place (a checkpoint load's ``copy_``), which
    neither the storage pointer nor the shape shows; torch has no public accessor for it.
    """
    return int(tensor._version)



def lerp_all_(tensors: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weight: float) -> None:
    """``tensors[i].lerp_(ends[i], weight)`` for every ``i`` in one call (``torch._foreach_lerp_``, what torch's
    optimizers use for their moving averages with ``foreach=True``): a loop of ``lerp_`` costs a Python round trip
    and a kernel launch per tensor, the weight average's update runs after every step. The same arithmetic per
    element; tensors on different devices are taken one by one."""
    torch._foreach_lerp_(list(tensors), list(ends), weight)

def mkldnn_fp16_supported() -> bool:
    """Whether oneDNN has fp16 kernels for this CPU.

    DeepSpeed's CPU accelerator asks exactly this (``torch.ops.mkldnn._is_mkldnn_fp16_supported``)
    before it accepts fp16 ("Type fp16 is not supported on your device"); asking the same question
    before launch refuses the config with our message instead of a crash on the ranks. A torch build
    without oneDNN raises ``AttributeError`` or ``RuntimeError`` (the caller reads that as no).
    """
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def start_cuda_memory_history(max_entries: int) -> None:
    """Record every CUDA allocation with its stack (``torch.cuda.memory._record_memory_history``):
    torch's memory-snapshot tool has only this underscored entry point."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocation history to ``path`` (a pickle https://pytorch.org/memory_viz reads)
    and stop recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def reset_compile_counts() -> None:
    """Forget every compiled graph and zero torch.compile's tallies (``torch._dynamo.reset`` and its
    ``utils.counters``): torch has no public way to count the graphs a compilation made."""
    # lazy: TorchDynamo takes seconds to import: only with compile_layers
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since :func:`reset_compile_counts`: one graph for all transformer
    blocks is what ``compile_layers`` wants; one per block means a recompile for each."""
    # lazy: TorchDynamo takes seconds to import: only with compile_layers
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def set_collective_timeouts(timeout: timedelta, barrier_first: bool = False) -> int:
    """Give every process group of this rank (the default one included) ``timeout`` for its collectives; returns how
    many. torch sets a group's timeout only when it is created; its own setter is private (``_set_pg_timeout``,
    what torchtitan's ``set_pg_timeouts`` uses after the first step: torchtitan/distributed/utils.py:563@b5bcd76), and
    the groups a rank belongs to are listed only in ``_world.pg_map``. ``barrier_first``: torchtitan's barrier, so no
    rank issues collectives under the shorter timeout while a slower one is still within the old one."""
    if not dist.is_initialized():
        return 0
    if barrier_first:
        dist.barrier()
    count = 0
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, AssertionError, RuntimeError):
            continue  # a group this rank is not part of, or a backend without a settable timeout
        count += 1
    return count


def collective_timeouts() -> list[timedelta]:
    """The timeout of every process group of this rank (its backend's ``options._timeout``: torch has no public
    getter), to check what :func:`set_collective_timeouts` did."""
    if not dist.is_initialized():
        return []
    found = []
    for group in list(c10d._world.pg_map):
        for device in group._device_types:
            found.append(group._get_backend(device).options._timeout)
    return found


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` with no peer: torch.distributed on torch's ``fake`` backend
    (``FakeProcessGroup``), where every collective and send returns at once and moves nothing, and groups of any
    ranks can be made. The rehearsal (megatron/app/rehearsal.py) builds each rank's part of the model this way.
    The backend registers itself, and its store lives, only in ``torch.testing._internal.distributed.fake_pg``:
    torch has no public name for either. The process group is destroyed on the way out."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: a fake one cannot replace it")
    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank<r>]: " and never takes it back
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@contextlib.contextmanager
def meta_tensors_stay_on_meta() -> Iterator[None]:
    """Inside, copying a tensor of the ``meta`` device to another device (``aten._to_copy``, what
    ``tensor.to(device)`` and ``module.to(device)`` run) gives a meta tensor again instead of failing ("Cannot copy
    out of meta tensor"). DeepSpeed's ``PipelineModule`` moves the stage it built to the accelerator in its
    constructor (``self.to(get_accelerator().device_name(local_rank))``, deepspeed/runtime/pipe/module.py:215 in
    0.19.8), so a stage built on the meta device can only stay there this way; every other op runs as it is.
    torch's hook for this is a ``TorchDispatchMode`` (``torch.utils._python_dispatch``), which has no public
    spelling."""
    to_copy = torch.ops.aten._to_copy.default

    class _MetaStaysMeta(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is to_copy and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                kwargs["device"] = torch.device("meta")
            return func(*args, **kwargs)

    with _MetaStaysMeta():
        yield


def share_cuda_storage(storage: Any) -> tuple[Any, ...]:
    """``storage._share_cuda_()``: the CUDA IPC handle of a GPU storage as the eight values
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` takes in another process (device, handle, size and
    offset in bytes, ref-counter handle and offset, event handle, event_sync_required). GPT-NeoX's weight server sends
    exactly these (megatron/model/weight_server.py @ea7aefd8); torch's public route (``torch.multiprocessing``
    queues) pickles them through its own reducer, not as a message a non-torch-multiprocessing peer reads."""
    return tuple(storage._share_cuda_())


def share_cpu_storage(storage: torch.UntypedStorage) -> tuple[bytes, bytes, int]:
    """``storage._share_filename_cpu_()``: moves a CPU storage into shared memory in place (every tensor viewing it
    keeps working, now on the shared pages) and returns (manager socket, shared-memory name, size in bytes), which
    :func:`open_shared_cpu_storage` opens in another process - torch's ``file_system`` sharing strategy, the CPU
    counterpart of :func:`share_cuda_storage` (``torch.multiprocessing`` wraps the same call in its reducer)."""
    manager, handle, size = storage._share_filename_cpu_()
    return manager, handle, int(size)


def open_shared_cpu_storage(manager: bytes, handle: bytes, size: int) -> torch.UntypedStorage:
    """The storage :func:`share_cpu_storage` shared, mapped in this process
    (``torch.UntypedStorage._new_shared_filename_cpu``)."""
    return torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
