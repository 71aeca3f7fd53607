"""``streaming``: the logical streams' positions go into every checkpoint (``TrainState.stream``).

After each step every rank hands the positions it knows at the step's consumed sample count
(:meth:`~megatron.data.streaming.StreamingDataset.local_state`: the streams whose sample before it the rank cut),
they are gathered on all ranks, and the checkpoint the step's ``after_step`` writes holds them. The positions are
taken where the step ends, not where the prefetcher has read to. The load side is ``restore_stream`` (called by
``pretrain`` before the first sample is read)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron.data.batch import BatchLayout
from megatron.data.streaming import StreamingDataset, rank_streams
from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks, TrainState
from megatron.training.train_config import TrainConfig


def streamed(dataset: Any) -> StreamingDataset | None:
    """The ``StreamingDataset`` behind the train split (under its token-range check), or None."""
    inner = getattr(dataset, "dataset", dataset)
    return inner if isinstance(inner, StreamingDataset) else None


def restore_stream(dataset: Any, state: TrainState, batch: BatchLayout, dp_rank: int) -> None:
    """Before the first sample: read only this rank's streams, from where the checkpoint left them."""
    stream = streamed(dataset)
    if stream is None:
        return
    stream.read_only(rank_streams(stream.num_streams, batch.global_size, batch.per_rank, dp_rank))
    stream.load_state(state.stream)


def gathered_state(stream: StreamingDataset, consumed_samples: int) -> dict[str, Any]:
    """The streams' state at ``consumed_samples`` from every rank's positions (a collective)."""
    mine = (stream.local_state(consumed_samples), stream.documents)
    parts: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    return stream.state_at(consumed_samples, [p[0] for p in parts], [p[1] for p in parts])


def build_stream_state(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """On with ``streaming`` when checkpoints are saved."""
    stream = streamed(setup.train_data)
    if stream is None or setup.checkpoint_keys.save is None:
        return None

    def after_update(_eng: Any, state: TrainState) -> None:
        state.stream = gathered_state(stream, state.consumed_samples)

    return LoopHooks(name="streaming", after_update=after_update)
