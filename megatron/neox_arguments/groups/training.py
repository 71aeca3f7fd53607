"""Regularisation, fp16 loss scaling and the micro-batch alias: the keys of a training run that are not
the architecture and not yet declared beside their component (the loop's, the optimizer's,
activation checkpointing's and the objective's are, in ``megatron/training/``; the data's in
``megatron/data/config.py``; the checkpoint keys and tokenizer files in ``megatron/checkpointing/config.py``
and ``megatron/tokenizer/config.py``).

Besides GPT-NeoX's keys it holds Deepy's extras: Levanter's micro-batch name and the run directory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, obsolete


class TrainingArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTraining`` group."""

    use_shared_fs: bool = True
    """All nodes see the same filesystem, so only one rank needs to build the sample index."""

    data_impl: Literal["infer", "mmap", "cached"] = obsolete(
        "infer", "it reads GPT-NeoX's legacy IndexedDataset files (not memory-mapped) into memory; GPT-NeoX's "
        "tools/datasets/preprocess_data.py writes the memory-mapped format by default and Deepy's always, which "
        "infer and mmap read: preprocess the data again (--dataset-impl mmap) and use mmap", values=("cached",))
    """On-disk dataset format; `infer` reads it from the files."""

    batch_size: int | None = Field(None, ge=1)
    """Micro-batch size per data-parallel rank; an older name for train_micro_batch_size_per_gpu."""


    clip_grad: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    hysteresis: int = Field(2, ge=1)
    """fp16: number of overflowed steps tolerated before the loss scale is lowered."""

    dynamic_loss_scale: bool | None = None
    """fp16: adapt the loss scale to overflows; unset means dynamic unless loss_scale is given."""

    loss_scale: float | None = Field(None, ge=0)
    """fp16: a fixed loss scale; unset or 0 means dynamic."""

    loss_scale_window: float = Field(1000.0, gt=0)
    """fp16: number of overflow-free steps before the loss scale is raised."""

    min_scale: float = Field(1.0, gt=0)
    """fp16: lowest loss scale allowed."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    per_device_parallelism: int | None = Field(None, ge=1)
    """Levanter's name for the micro batch per device; read as train_micro_batch_size_per_gpu."""

    run_dir: str | None = None
    """Directory where the resolved config (deepy_config.json) is written; unset means the run's own
    directory <log_dir>/<run name> (runs/<run name> without log_dir), which holds its metrics.jsonl too."""
