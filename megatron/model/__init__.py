"""The GPT architecture: config, model, pipeline specs, loss, parameter/FLOP counts."""

from megatron.model.config import GPTConfig
from megatron.model.flops import flops_per_token, num_parameters
from megatron.model.gpt import GPTModel
from megatron.model.kv_cache import KVCache
from megatron.model.loss import lm_loss, loss_fn
from megatron.model.partitioning import (
    TPPartition,
    tp_partition_of,
    tp_partition_patterns,
    universal_checkpoint_info,
)
from megatron.model.pipeline import pipeline_layer_specs

__all__ = [
    "GPTConfig",
    "GPTModel",
    "KVCache",
    "TPPartition",
    "flops_per_token",
    "lm_loss",
    "loss_fn",
    "num_parameters",
    "pipeline_layer_specs",
    "tp_partition_of",
    "tp_partition_patterns",
    "universal_checkpoint_info",
]
