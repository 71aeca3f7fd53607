"""Model parallel utilities: process groups, tensor-parallel layers, mappings, loss, RNG."""

from megatron.mpu.topology import *  # noqa: F401,F403  (the parallel-state API is the package API)
from megatron.mpu.topology import Coordinates, build_topology, initialize_model_parallel  # noqa: F401
