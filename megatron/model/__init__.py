"""The GPT architecture: config, model, pipeline specs, loss, parameter/FLOP counts.

Conventions:
* `GPTModel(config)(tokens [b, s], position_ids=None, attention_mask=None, kv_cache=None)` returns
  this tp rank's vocabulary shard of the logits `[b, s, padded_vocab_size / tp]` (a value head:
  `[b, s, 1]`). Inside, activations are `[s, b, h]` (`[s/tp, b, h]` under sequence parallelism).
* `attention_mask` is bool, True = may attend, combined with the causal mask (SDPA's convention,
  the opposite of GPT-NeoX's "True = masked").
* Parameter names are canonical (`layers.3.attention.query_key_value.weight`); each full weight is
  drawn from `(config.seed, name)` and then sharded, so every tp/pp layout starts identical.
* Fused weights: QKV rows are `[q; k; v]`, a gated MLP's first projection is `[gate; up]`; tp
  rank r holds chunk r of each part (`tp_partition_patterns`, `mpu.initialize_weights.shard_tensor`).
* `lm_loss(logits, labels, loss_mask)` is the mean over counted tokens (labels < 0 are skipped). The
  training losses (per `train_impl`, normalised over the global batch) live in
  `megatron/training/objectives`.
"""

from megatron.model.config import GPTConfig
from megatron.model.flops import flops_per_token, num_parameters
from megatron.model.gpt import GPTModel
from megatron.model.kv_cache import KVCache
from megatron.model.loss import lm_loss
from megatron.model.partitioning import (
    TPPartition,
    tp_partition_of,
    tp_partition_patterns,
)
from megatron.model.pipeline import pipeline_layer_specs

__all__ = [
    "GPTConfig",
    "GPTModel",
    "KVCache",
    "TPPartition",
    "flops_per_token",
    "lm_loss",
    "num_parameters",
    "pipeline_layer_specs",
    "tp_partition_of",
    "tp_partition_patterns",
]
