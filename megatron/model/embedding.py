"""Token embedding (vocab-parallel) + absolute positions + dropout: tokens [b, s] -> hidden [s, b, h]."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig
from megatron.model.positional import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding, default_position_ids
from megatron.model.transformer_options import POSITIONAL
from megatron.mpu.layers import VocabParallelEmbedding
from megatron.mpu.mappings import scatter_to_sequence_parallel_region
from megatron.mpu.random import tensor_parallel_rng
from megatron.mpu.topology import get_tensor_model_parallel_world_size

POSITIONAL.attach("learned", embedding=LearnedPositionalEmbedding)
POSITIONAL.attach("sinusoidal", embedding=SinusoidalPositionalEmbedding)


class GPTEmbedding(nn.Module):
    """Looks tokens up in the vocab-parallel table, adds absolute positions (if any), applies dropout.

    The output projection reuses `word_embeddings.weight` unless weights are untied.
    """

    def __init__(self, config: GPTConfig, name: str = "embedding") -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab,
            config.arch.hidden,
            name=f"{name}.word_embeddings",
            init_fn=config.init_fn(),
            seed=config.seed,
            params_dtype=config.params_dtype,
        )
        table = POSITIONAL[config.pos_emb].embedding
        self.position_embeddings = None if table is None else table(config, f"{name}.position_embeddings")
        self.dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and get_tensor_model_parallel_world_size() > 1

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # looked up in [s, b] order: the hidden states come out sequence-first without a transpose copy
        x_sbh = self.word_embeddings(tokens.t())  # [s, b, h]
        if self.position_embeddings is not None:
            positions = default_position_ids(tokens) if position_ids is None else position_ids
            x_sbh = x_sbh + self.position_embeddings(positions).transpose(0, 1).to(x_sbh.dtype)  # + [s, b|1, h]
        if self.sequence_parallel:
            # positions were added on the full sequence, so their gradient is whole on every rank
            x_sbh = scatter_to_sequence_parallel_region(x_sbh)  # [s/tp, b, h]
        if not self.training or self.dropout == 0.0:
            return x_sbh
        with tensor_parallel_rng() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(x_sbh, self.dropout, training=True)
