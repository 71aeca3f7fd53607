"""``profile`` and ``memory_profiling``: torch.profiler traces and CUDA memory snapshots over a range
of steps.

- ``profile: true``: ``torch.profiler`` records steps ``profile_step_start``..``profile_step_stop``
  (CPU activity, plus CUDA kernels on GPUs, with shapes and memory) and writes one trace per rank
  with ``tensorboard_trace_handler`` into the TensorBoard directory, where TensorBoard's profiler
  plugin (or Perfetto / chrome://tracing, the files are Chrome traces) shows them.
- ``memory_profiling: true``: CUDA allocator history is recorded over the same steps and dumped as
  ``memory_snapshot_rank<r>_step<n>.pickle`` (open it at https://pytorch.org/memory_viz). It needs a
  GPU: the pre-launch check refuses it on a CPU machine, and a rank without CUDA refuses it too.
"""

from __future__ import annotations

import os
from typing import Any

import torch.profiler as tp

from megatron.errors import ConfigError
from megatron.logging.config import ProfileSettings
from megatron.torch_internals import dump_cuda_memory_snapshot, start_cuda_memory_history


class StepProfiler:
    """Call :meth:`before_step` with the iteration about to run and :meth:`after_step` once it ran."""

    def __init__(self, settings: ProfileSettings, rank: int, cuda: bool) -> None:
        if settings.memory_snapshot and not cuda:
            raise ConfigError(
                "memory_profiling=true needs a GPU (it records the CUDA allocator's history), and this rank "
                "has none: remove memory_profiling, or use profile: true for CPU traces"
            )
        self.settings = settings
        self.rank = rank
        self.cuda = cuda
        self._profiler: Any = None
        self._recording_memory = False
        self.written: list[str] = []

    def before_step(self, iteration: int) -> None:
        # the torch profiler starts one step early: that warm-up step is recorded and discarded, so
        # the first recorded step does not carry the profiler's own start-up cost
        warmup = 1 if self.settings.start > 1 else 0
        if self.settings.torch_profiler and iteration == self.settings.start - warmup:
            self._start_torch_profiler(warmup)
        if self.settings.memory_snapshot and iteration == self.settings.start:
            start_cuda_memory_history(max_entries=200_000)
            self._recording_memory = True

    def _start_torch_profiler(self, warmup: int) -> None:
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
        os.makedirs(self.settings.trace_dir, exist_ok=True)
        steps = self.settings.stop - self.settings.start + 1
        self._profiler = tp.profile(
            activities=activities,
            # a schedule, so each recorded step is labelled ProfilerStep#n in the trace
            schedule=tp.schedule(wait=0, warmup=warmup, active=steps, repeat=1),
            record_shapes=True,
            profile_memory=True,
            with_stack=False,
            on_trace_ready=tp.tensorboard_trace_handler(self.settings.trace_dir, worker_name=f"rank{self.rank}"),
        )
        self._profiler.__enter__()

    def after_step(self, iteration: int) -> None:
        if self._profiler is not None:
            self._profiler.step()
        if iteration != self.settings.stop:
            return
        self.stop(iteration)

    def stop(self, iteration: int) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
            self.written.append(self.settings.trace_dir)
        if self._recording_memory:
            os.makedirs(self.settings.memory_dir, exist_ok=True)
            path = os.path.join(self.settings.memory_dir, f"memory_snapshot_rank{self.rank}_step{iteration}.pickle")
            dump_cuda_memory_snapshot(path)
            self._recording_memory = False
            self.written.append(path)
