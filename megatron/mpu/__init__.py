"""Model parallel utilities: process groups, tensor-parallel layers, mappings, loss, RNG.

The names below are imported on first use, not with the package: the parallelism keys' group
(``parallel_config.py``) is part of the argument schema, which ``deepy.py`` and the launcher load
without DeepSpeed, while the rest of the package needs it (and torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
    from megatron.mpu.layers import (  # noqa: F401
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        parallel_lm_logits,
    )
    from megatron.mpu.mappings import (  # noqa: F401
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
        scatter_to_tensor_model_parallel_region,
    )
    from megatron.mpu.random import get_rng_tracker, model_parallel_manual_seed, tensor_parallel_rng  # noqa: F401
    from megatron.mpu.topology import *  # noqa: F401,F403

_EXPORTS = {
    # the parallel-state API (topology.py's public names) is the package API
    "Coordinates": "topology",
    "build_topology": "topology",
    "initialize_model_parallel": "topology",
    "model_parallel_is_initialized": "topology",
    "destroy_model_parallel": "topology",
    "get_topology": "topology",
    "get_coordinates": "topology",
    "get_tensor_model_parallel_group": "topology",
    "get_tensor_model_parallel_world_size": "topology",
    "get_tensor_model_parallel_rank": "topology",
    "get_tensor_model_parallel_src_rank": "topology",
    "get_pipe_parallel_group": "topology",
    "get_pipe_parallel_world_size": "topology",
    "get_pipe_parallel_rank": "topology",
    "get_data_parallel_group": "topology",
    "get_data_parallel_world_size": "topology",
    "get_data_parallel_rank": "topology",
    "get_context_parallel_group": "topology",
    "get_context_parallel_world_size": "topology",
    "get_context_parallel_rank": "topology",
    "get_data_shard_rank": "topology",
    "get_data_shard_count": "topology",
    "new_data_shard_group": "topology",
    "collective_device": "topology",
    "rank0_decides": "topology",
    # the names DeepSpeed looks for on the module passed as deepspeed.initialize(mpu=...)
    "get_model_parallel_group": "topology",
    "get_model_parallel_world_size": "topology",
    "get_model_parallel_rank": "topology",
    "get_model_parallel_src_rank": "topology",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "parallel_lm_logits": "layers",
    "copy_to_tensor_model_parallel_region": "mappings",
    "gather_from_sequence_parallel_region": "mappings",
    "gather_from_tensor_model_parallel_region": "mappings",
    "reduce_from_tensor_model_parallel_region": "mappings",
    "reduce_scatter_to_sequence_parallel_region": "mappings",
    "scatter_to_sequence_parallel_region": "mappings",
    "scatter_to_tensor_model_parallel_region": "mappings",
    "get_rng_tracker": "random",
    "model_parallel_manual_seed": "random",
    "tensor_parallel_rng": "random",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
