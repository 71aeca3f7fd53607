"""The keys of the weight server (``weight_server.py``): handing the live weights to a generation server (GPT-NeoX's
online REINFORCE, where a vLLM fork generates the rollouts with the trainer's own weights). GPT-NeoX declares them
in ``NeoXArgsModel`` (megatron/neox_arguments/neox_args.py:510-520 @ea7aefd8); here beside the server."""

from __future__ import annotations

from megatron.config_schema import ArgGroup


class WeightServerArgs(ArgGroup):
    """GPT-NeoX's weight-server keys, which it files under ``NeoXArgsModel``."""

    serve_model_weights: bool = False
    """Before the first step, each rank waits for one generation server to connect to its weight_server_port and
    hands it a pointer to every tensor of its live weights (GPT-NeoX's protocol, docs/reinforce.md): CUDA IPC handles
    on a GPU, shared-memory handles on the CPU; the server then reads the weights as they train."""

    weight_server_port: int | list[int] = 6000
    """Port rank r serves its weights on (on localhost): this port + r, or entry r of a list; GPT-NeoX at
    ea7aefd8 declares the key but its training.py always serves on 6000 + r, the default here."""
