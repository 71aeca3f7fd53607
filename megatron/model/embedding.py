"""Token embedding (vocab-parallel) + absolute positions + dropout: tokens [b, s] -> hidden [s, b, h]."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig
from megatron.model.mup import output_mult, straight_through_mult
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
        # muP (megatron/model/mup.py): GPT-NeoX multiplies the positions with or without use_mup
        self.rp_mult = config.mup_rp_embedding_mult
        self.embedding_mult = config.mup_embedding_mult if config.use_mup else 1.0
        self.mup_output_mult = output_mult(config)  # the tied head's input multiplier, set by apply_base_shapes
        # Gemma: the token embeddings times sqrt(hidden), the factor in their dtype (scale_embeddings_by_sqrt_hidden)
        self.embedding_scale = math.sqrt(config.arch.hidden) if config.scale_embeddings_by_sqrt_hidden else None
        self.final_logit_softcapping = config.final_logit_softcapping  # read by the tied head (pipeline.py)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # looked up in [s, b] order: the hidden states come out sequence-first without a transpose copy
        x_sbh = self.word_embeddings(tokens.t())  # [s, b, h]
        if self.embedding_scale is not None:  # rounded to the table's dtype first, as HF's embed_scale.to(dtype)
            x_sbh = x_sbh * torch.tensor(self.embedding_scale, dtype=x_sbh.dtype, device=x_sbh.device)
        if self.position_embeddings is not None:
            positions = default_position_ids(tokens) if position_ids is None else position_ids
            positions_sbh = self.position_embeddings(positions).transpose(0, 1)  # [s, b|1, h]
            if self.rp_mult != 1.0:
                positions_sbh = positions_sbh * self.rp_mult
            x_sbh = x_sbh + positions_sbh.to(x_sbh.dtype)
        if self.sequence_parallel:
            # positions were added on the full sequence, so their gradient is whole on every rank
            x_sbh = scatter_to_sequence_parallel_region(x_sbh)  # [s/tp, b, h]
        if self.training and self.dropout > 0.0:
            with tensor_parallel_rng() if self.sequence_parallel else contextlib.nullcontext():
                x_sbh = F.dropout(x_sbh, self.dropout, training=True)
        return straight_through_mult(x_sbh, self.embedding_mult)  # muP's embedding multiplier, after dropout
