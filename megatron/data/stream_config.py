"""The streaming keys (``megatron/data/streaming.py``): train_urls read and tokenized while training, and how many
logical streams cut the global order. Deepy additions (GPT-NeoX reads only prepared .bin/.idx data); the data keys'
group (:class:`~megatron.data.config.DataArgs`) includes them, so the datasets read them from ``DataRun.keys``."""

from __future__ import annotations

from pydantic import Field

from megatron.config_schema import ArgGroup


class StreamArgs(ArgGroup):
    """Deepy's streaming of ``train_urls``, filed with the data keys of GPT-NeoX's ``NeoXArgsTraining`` group
    (GPT-NeoX has none; fms-fsdp's stateful loader and Levanter's streaming cache are the anchors' ways)."""

    streaming: bool = False
    """Deepy addition: read train_urls lazily and tokenize them while training (no cache is built first): jsonl
    (.gz/.zst) shards, .parquet/.arrow files (column 'text' tokenized, or an int-list column 'input_ids'/'tokens'
    read as is) and datasets' save_to_disk directories, tokenized as the cache is (the same ids). Documents go to
    stream_shards logical streams, each packed back to back; the checkpoint keeps each stream's position, so a
    resume at any dp/tp/pp reads exactly the samples the uninterrupted run would (docs/streaming.md).
    validation_urls are still tokenized once into the cache. Only with train_urls, pack_impl packed, train_iters."""

    stream_shards: int | None = Field(None, ge=1)
    """Deepy addition: logical streams S of streaming: global document D goes to stream D mod S and global
    sample i is sample i // S of stream i mod S. Must divide the global batch; unset: the global batch (each
    stream read by one data-parallel rank). 1: every rank reads every document, in file order (the samples of
    the offline path with data_shuffle: false)."""
