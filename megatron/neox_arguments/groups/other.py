"""Process identity, seeds and runtime bookkeeping.

Several keys here (rank, iteration, do_train, ...) are runtime values Deepy fills in; configs
normally leave them alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, not_supported


class OtherArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsOther`` group."""

    distributed_backend: Literal["nccl", "gloo", "mpi"] | None = None
    """torch.distributed backend. GPT-NeoX defaults to nccl, which cannot run without GPUs; Deepy's
    default None picks gloo on CPU and nccl on GPU."""

    local_rank: int | None = Field(None, ge=0)
    """Rank within the node; set by the launcher."""

    rank: int | None = Field(None, ge=0)
    """Global rank; set by the launcher."""

    lazy_mpu_init: bool = not_supported(False)
    """Let an external framework set up model-parallel groups instead of initialize()."""

    short_seq_prob: float = not_supported(0.1)
    """Probability of drawing a shortened sample (a BERT-era option GPT training never uses)."""

    adlr_autoresume: bool = not_supported(False)
    """Cooperate with NVIDIA's internal ADLR autoresume scheduler."""

    adlr_autoresume_interval: int = not_supported(1000)
    """Steps between ADLR autoresume checks."""

    onnx_safe: bool = not_supported(False)
    """Avoid operators that ONNX export cannot handle."""

    deepscale: bool = not_supported(False)
    """Old alias for `deepspeed`, kept by DeepSpeed for compatibility."""

    deepscale_config: str | None = not_supported(None)
    """Old alias for a DeepSpeed JSON config path."""

    user_script: str | None = None
    """Worker script the runner starts on every rank; set by Deepy."""

    do_train: bool | None = None
    """Whether a training split exists; derived from the data."""

    do_valid: bool | None = None
    """Whether a validation split exists; derived from the data."""

    do_test: bool | None = None
    """Whether a test split exists; derived from the data."""

    global_num_gpus: int | None = Field(None, ge=1)
    """Total number of devices in the job; derived at launch."""
