"""``serve_model_weights`` as a feature: before the first step every rank hands one generation server pointers to its
live weights (``weight_server.py``), then the ranks wait for each other, as GPT-NeoX's training.py:257-260 does
(@ea7aefd8) after its checkpoint load."""

from __future__ import annotations

import torch.distributed as dist

from megatron.engine.build import Engine
from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks, TrainState
from megatron.training.train_config import TrainConfig
from megatron.training.weight_server import rank_port, serve_once


def build_weight_server(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None with ``serve_model_weights: false``."""
    keys = run.weight_server
    if not keys.serve_model_weights:
        return None
    port = rank_port(keys.weight_server_port, setup.rank)

    def serve(eng: Engine, _state: TrainState) -> None:
        serve_once(eng.engine, port)  # the engine's state_dict, as GPT-NeoX serves its DeepSpeed engine's
        if dist.is_initialized():
            dist.barrier()

    return LoopHooks(name="weight_server", resume=serve)
