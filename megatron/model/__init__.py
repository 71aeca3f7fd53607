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
  `megatron/objectives`.

The names below are imported on first use, not with the package: the argument layer reads the
adapter keys in ``megatron.model.lora_config`` and the architecture keys in ``megatron.model.config``
without paying for torch and DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron.model.config import GPTConfig  # noqa: F401
    from megatron.model.flops import flops_per_token, num_parameters  # noqa: F401
    from megatron.model.gpt import GPTModel  # noqa: F401
    from megatron.model.kv_cache import KVCache  # noqa: F401
    from megatron.model.loss import lm_loss  # noqa: F401
    from megatron.model.partitioning import TPPartition, tp_partition_of, tp_partition_patterns  # noqa: F401
    from megatron.model.pipeline import pipeline_layer_specs  # noqa: F401

_EXPORTS = {
    "GPTConfig": "config",
    "flops_per_token": "flops",
    "num_parameters": "flops",
    "GPTModel": "gpt",
    "KVCache": "kv_cache",
    "lm_loss": "loss",
    "TPPartition": "partitioning",
    "tp_partition_of": "partitioning",
    "tp_partition_patterns": "partitioning",
    "pipeline_layer_specs": "pipeline",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
