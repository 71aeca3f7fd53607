"""Model parallel utilities: process groups, tensor-parallel layers, mappings, loss, RNG."""

from megatron.mpu.topology import *  # noqa: F401,F403  (the parallel-state API is the package API)
from megatron.mpu.topology import Coordinates, build_topology, initialize_model_parallel  # noqa: F401
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
