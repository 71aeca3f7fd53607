"""The feed-forward block: h -> ffn (column-parallel) -> activation -> h (row-parallel).

The widths are GPT-NeoX's (``GPTConfig.mlp_widths``, ``megatron/model/mlp_width.py``). A gated
activation computes ``act(gate) * up`` from the first projection's two halves; Deepy keeps them as
``[gate; up]`` (GPT-NeoX's ``Gated_Activation`` takes ``x, gate = chunk(2)`` of each tp rank's
slice: ``checkpointing/neox/layout.py`` converts between the two).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.activations import get_activation
from megatron.model.config import GPTConfig
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """Gated activations make the first projection `[gate; up]`, twice `ffn_hidden_size` wide."""

    def __init__(self, config: GPTConfig, name: str) -> None:
        super().__init__()
        self.activation = get_activation(config.mlp_activation)
        widths = config.mlp_widths  # buildable: check_tensor_parallel ran in GPTModel / the pipeline specs
        ffn = widths.second
        sections = [widths.first // 2] * 2 if self.activation.gated else [widths.first]
        self.dense_h_to_4h = ColumnParallelLinear(
            config.arch.hidden,
            sum(sections),
            name=f"{name}.dense_h_to_4h",
            init_fn=config.init_fn(),
            seed=config.seed,
            bias=config.use_bias_in_mlp,
            sections=sections,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )
        self.dense_4h_to_h = RowParallelLinear(
            ffn,
            config.arch.hidden,
            name=f"{name}.dense_4h_to_h",
            init_fn=config.output_init_fn(),
            seed=config.seed,
            bias=config.use_bias_in_mlp,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        ffn_sbf = self.activation(self.dense_h_to_4h(x_sbh))  # [s, b, ffn/tp]
        return self.dense_4h_to_h(ffn_sbf)  # [s, b, h]
