"""Process identity, seeds and runtime bookkeeping.

Several keys here (rank, iteration, do_train, ...) are runtime values Deepy fills in; configs
normally leave them alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, obsolete


class OtherArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsOther`` group."""

    distributed_backend: Literal["nccl", "gloo", "mpi"] | None = None
    """torch.distributed backend. GPT-NeoX defaults to nccl, which cannot run without GPUs; Deepy's
    default None picks gloo on CPU and nccl on GPU."""

    local_rank: int | None = Field(None, ge=0)
    """Rank within the node; set by the launcher."""

    rank: int | None = Field(None, ge=0)
    """Global rank; set by the launcher."""

    lazy_mpu_init: bool = obsolete(False, (
        "it lets an outside framework finish GPT-NeoX's model-parallel set-up (its megatron/initialize.py "
        "returns finish_mpu_init instead of calling it); Deepy's ranks set up their own groups, also under "
        "torchrun (docs/torchrun.md): remove the key"))
    """Let an external framework set up model-parallel groups instead of initialize()."""

    short_seq_prob: float = obsolete(0.1, (
        "a BERT-era option GPT-NeoX declares but none of its code reads: remove the key"))
    """Probability of drawing a shortened sample (a BERT-era option GPT training never uses)."""

    adlr_autoresume: bool = obsolete(False, (
        "GPT-NeoX imports NVIDIA's internal userlib.auto_resume for it, which exists only on NVIDIA's ADLR "
        "clusters; Deepy restarts and requeues runs itself: use max_restarts and slurm_requeue"))
    """Cooperate with NVIDIA's internal ADLR autoresume scheduler."""

    adlr_autoresume_interval: int = obsolete(1000, (
        "the interval of adlr_autoresume (NVIDIA's internal cluster library); use max_restarts and "
        "slurm_requeue"))
    """Steps between ADLR autoresume checks."""

    onnx_safe: bool = obsolete(False, (
        "GPT-NeoX swaps GELU for its erf form for an ONNX export (megatron/model/activations.py); Deepy "
        "exports to Hugging Face, not ONNX, and its GELU is the erf form already: remove the key"))
    """Avoid operators that ONNX export cannot handle."""

    deepscale: bool = obsolete(False, (
        "DeepSpeed's name from before 2020, which GPT-NeoX declares deprecated and never reads; deepy.py "
        "builds the DeepSpeed config from the other keys: remove the key"))
    """Old alias for `deepspeed`, kept by DeepSpeed for compatibility."""

    deepscale_config: str | None = obsolete(None, (
        "the deprecated name of a DeepSpeed JSON file, which GPT-NeoX never reads; deepy.py builds the "
        "DeepSpeed config from the other keys (deepspeed_extra_args adds to it): remove the key"))
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
