"""One transformer block (sequential or GPT-J parallel residual), its norms before, after or around the
sublayers as ``norm_placement`` says."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.attention import SelfAttention
from megatron.model.block import Block
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import KVCache
from megatron.model.mlp import MLP
from megatron.model.moe import MoELayer
from megatron.model.norms import build_norm
from megatron.model.transformer_options import NORM_PLACEMENTS
from megatron.mpu.layers import mark_partial_over_tensor_parallel
from megatron.mpu.random import tensor_parallel_rng
from megatron.mpu.topology import get_tensor_model_parallel_world_size


class TransformerLayer(Block):
    """x + attn(norm(x)), then x + mlp(norm(x)); or, with `gpt_j_residual`, both from the same x. With
    `norm_placement` post: x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2); sandwich: x + norm(attn(norm(x))),
    then x + norm(mlp(norm(x))) (Gemma 2/3)."""

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        super().__init__()
        name = f"layers.{layer_number}"
        self.layer_number = layer_number
        self.gpt_j_residual = config.gpt_j_residual
        placement = NORM_PLACEMENTS[config.norm_placement]
        self.input_layernorm = build_norm(config.norm_settings) if placement.before else None
        self.attention = SelfAttention(config, f"{name}.attention", layer_number)
        shared_norm = config.gpt_j_residual and config.gpt_j_tied
        own_mlp_norm = placement.before and not shared_norm
        self.post_attention_layernorm = build_norm(config.norm_settings) if own_mlp_norm else None
        # norms of the sublayers' outputs, before the residual add
        self.attention_output_norm = build_norm(config.norm_settings) if placement.after else None
        self.mlp_output_norm = build_norm(config.norm_settings) if placement.after else None
        # a mixture of experts replaces the MLP in every moe_expert_interval-th block
        moe = config.is_moe_layer(layer_number)
        self.mlp = MoELayer(config, f"{name}.mlp", layer_number) if moe else MLP(config, f"{name}.mlp")
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and get_tensor_model_parallel_world_size() > 1
        if self.sequence_parallel:
            # norms see only this rank's part of the sequence: their gradients are partial sums
            norms = [self.input_layernorm, self.post_attention_layernorm, self.attention_output_norm,
                     self.mlp_output_norm]
            mark_partial_over_tensor_parallel(p for n in norms if n is not None for p in n.parameters())

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        # positional only: activation checkpointing hands the layer its arguments by position
        attend = (position_ids, attention_mask, kv_cache, document_ids)
        if self.gpt_j_residual:
            attn_sbh = self.attention(_norm(self.input_layernorm, x), *attend)
            return x + self._drop(attn_sbh) + self._drop(self.mlp(self._mlp_norm(x)))
        attn_sbh = self.attention(_norm(self.input_layernorm, x), *attend)
        x = x + self._drop(_norm(self.attention_output_norm, attn_sbh))
        x = x + self._drop(_norm(self.mlp_output_norm, self.mlp(self._mlp_norm(x))))
        return x

    def _mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        own = self.post_attention_layernorm  # None: the MLP shares the attention's norm, or has none (post)
        return _norm(self.input_layernorm, x) if own is None else own(x)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        # under sequence parallelism each rank holds different tokens: use the per-rank stream
        with tensor_parallel_rng() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(x, self.hidden_dropout, training=True)


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, or ``x`` where the placement puts no norm."""
    return x if norm is None else norm(x)
