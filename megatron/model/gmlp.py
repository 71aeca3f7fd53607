"""gMLP blocks as GPT-NeoX builds them (``megatron/model/gmlp.py``, commit ea7aefd8), tensor-parallel.

One block (``GMLPBlock``, attention_config type ``gmlp``, or ``amlp`` with a small attention) is

    y = act(input_linear(norm(x)))              column-parallel, 2 x 4h wide: rank r holds [res_r; gate_r]
    gate = proj(sgu.norm(gate)) (+ attn(y))     spatial gating: a causal seq x seq projection over positions
    out = output_linear(gate * res)             row-parallel

and, as in GPT-NeoX, that is the whole block: no residual connection around it, and the two projections'
biases exist (in checkpoints and the parameter count) but are never added (GPT-NeoX builds them with
``skip_bias_add`` and drops the returned bias), so they stay at zero and are not trained. ``proj`` starts
at weight 0, bias 1 (the block starts as a plain gated MLP); the small attention (``amlp``) is one head of
width ``gmlp_attn_dim`` over the whole input ``y``, its projections initialised as torch initialises
``nn.Linear``.

Tensor parallelism as GPT-NeoX splits the block (the inner width over ranks, ``proj`` on every rank), with
three differences that make every layout compute the tp = 1 model: ``sgu.norm`` normalises over the whole
inner width (statistics summed over ranks; GPT-NeoX normalises each rank's slice), ``proj``'s gradient is
summed over ranks (GPT-NeoX lets each rank's copy drift), and the small attention's input projection is
row-parallel with its output summed (GPT-NeoX gives each rank its own). Decoding keeps the normalised gates
(and the small attention's keys and values) of the tokens so far, with their positions, in the ``KVCache``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activations import get_activation
from megatron.model.block import Block, layer_parameter, torch_linear_default
from megatron.model.config import GPTConfig
from megatron.model.family_config import gmlp_shape
from megatron.model.kv_cache import KVCache
from megatron.model.norm_layers import RMSNorm, ScaleNorm
from megatron.model.norms import build_norm
from megatron.model.scans import real_tokens
from megatron.mpu.initialize_weights import set_tensor_model_parallel_attributes
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, mark_partial_over_tensor_parallel
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.mpu.topology import get_tensor_model_parallel_world_size


class _ColumnWithoutBias(ColumnParallelLinear):
    """A column-parallel layer whose bias GPT-NeoX creates but never adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, grad_is_partial=True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        return F.linear(x, self.weight)


class _RowWithoutBias(RowParallelLinear):
    """A row-parallel layer whose bias GPT-NeoX creates but never adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if get_tensor_model_parallel_world_size() == 1:
            return partial
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial)
        return reduce_from_tensor_model_parallel_region(partial)


def _summed(t: torch.Tensor) -> torch.Tensor:
    """Sum over tensor-parallel ranks, forward and backward (each rank uses the sum in its own way)."""
    return copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(t))


def _norm_over_ranks(x: torch.Tensor, norm: nn.Module, width: int) -> torch.Tensor:
    """``norm`` over the last dim, which tensor parallelism splits: statistics of all ``width`` channels."""
    if get_tensor_model_parallel_world_size() == 1:
        return norm(x)
    xf = x.float()
    if isinstance(norm, nn.LayerNorm):
        mean = _summed(xf.sum(-1, keepdim=True)) / width
        centred = xf - mean
        y = centred * torch.rsqrt(_summed(centred.pow(2).sum(-1, keepdim=True)) / width + norm.eps)
        y = y.to(x.dtype)
        if norm.weight is not None:
            y = y * norm.weight
        return y if norm.bias is None else y + norm.bias
    if isinstance(norm, RMSNorm):
        eps = norm.eps if norm.eps is not None else torch.finfo(xf.dtype).eps
        y = xf * torch.rsqrt(_summed(xf.pow(2).sum(-1, keepdim=True)) / width + eps)
        return y.to(x.dtype) * norm.weight
    if isinstance(norm, ScaleNorm):
        length = _summed(xf.pow(2).sum(-1, keepdim=True)).sqrt().clamp(min=norm.eps)
        return (xf / length).to(x.dtype) * norm.g
    # before launch: family_checks.gmlp_norm_splits_over_tensor_parallel (its SPLIT_NORMS)
    raise TypeError(f"{type(norm).__name__} over a tensor-parallel split is not built")


class _Projection(nn.Module):
    """A weight and a bias under one name (GPT-NeoX's ``proj_qkv`` / ``proj_ffn`` state-dict keys)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias


class TinyAttention(nn.Module):
    """GPT-NeoX's one-head attention of ``amlp`` blocks: `[b, s, 2ff/tp]` -> `[b, s, ff/tp]`."""

    def __init__(self, config: GPTConfig, ff: int, attn_dim: int, name: str) -> None:
        super().__init__()
        self.attn_dim = attn_dim
        qkv_init, ffn_init = torch_linear_default(2 * ff), torch_linear_default(attn_dim)
        seed, dtype = config.seed, config.params_dtype
        self.proj_qkv = _Projection(
            layer_parameter((3 * attn_dim, 2 * ff), name=f"{name}.proj_qkv.weight", init_fn=qkv_init, dim=1,
                            sections=(ff, ff), seed=seed, dtype=dtype),
            layer_parameter((3 * attn_dim,), name=f"{name}.proj_qkv.bias", init_fn=qkv_init, seed=seed, dtype=dtype))
        self.proj_ffn = _Projection(
            layer_parameter((ff, attn_dim), name=f"{name}.proj_ffn.weight", init_fn=ffn_init, dim=0, seed=seed,
                            dtype=dtype),
            layer_parameter((ff,), name=f"{name}.proj_ffn.bias", init_fn=ffn_init, dim=0, seed=seed, dtype=dtype))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """`[b, s, 2ff/tp]` -> `[b, s, 3a]`, the same on every rank."""
        partial = F.linear(x, self.proj_qkv.weight)
        if get_tensor_model_parallel_world_size() > 1:
            partial = reduce_from_tensor_model_parallel_region(partial)
        return partial + self.proj_qkv.bias

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q `[b, s, a]`, k/v `[b, seen + s, a]`, ``allowed`` `[b, s, seen + s]` -> `[b, s, ff/tp]`."""
        scores = torch.einsum("bnd,bmd->bnm", q.float(), k.float()) / math.sqrt(self.attn_dim)
        probs = scores.masked_fill(~allowed, -torch.inf).softmax(-1).to(v.dtype)
        out = torch.einsum("bnm,bmd->bnd", probs, v)  # [b, s, a]
        return F.linear(copy_to_tensor_model_parallel_region(out), self.proj_ffn.weight, self.proj_ffn.bias)


class SpatialGatingUnit(nn.Module):
    """`[b, s, 2ff/tp]` ([res; gate] of this rank) -> `[b, s, ff/tp]` = res * (proj(norm(gate)) (+ attn))."""

    def __init__(self, config: GPTConfig, ff: int, seq: int, attn_dim: int | None, name: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.ff = ff
        self.norm = build_norm(config.norm_settings, ff // tp)
        for p in self.norm.parameters():
            if p.numel() == ff // tp:
                set_tensor_model_parallel_attributes(p, True, 0)
            else:  # ScaleNorm's one gain: every rank's copy sees its channels only
                mark_partial_over_tensor_parallel([p])
        self.proj = nn.Linear(seq, seq, dtype=config.params_dtype)
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.proj.bias)
        mark_partial_over_tensor_parallel(self.proj.parameters())  # each rank mixes its own channels
        self.attn = None if attn_dim is None else TinyAttention(config, ff, attn_dim, f"{name}.attn")

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, attention_mask: torch.Tensor | None,
                real: torch.Tensor | None, past: tuple[torch.Tensor, torch.Tensor] | None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, s, _ = x.shape
        res, gate = x.chunk(2, dim=-1)
        gate = _norm_over_ranks(gate, self.norm, self.ff)
        if real is not None:
            gate = gate * real.unsqueeze(-1).to(gate.dtype)
        seen = 0 if past is None else past[1].shape[1]
        if positions is None:
            positions = torch.arange(seen, seen + s, device=x.device).expand(b, s)
        positions = positions.expand(b, s)
        extras = self.attn.qkv(x) if self.attn is not None else x.new_zeros(b, s, 0)  # [b, s, 3a]
        q, kv = extras.split([extras.shape[-1] // 3, 2 * extras.shape[-1] // 3], dim=-1)
        history = torch.cat([gate, kv], dim=-1)
        if past is not None:
            history = torch.cat([past[0], history], dim=1)
            key_positions = torch.cat([past[1], positions], dim=1)
        else:
            key_positions = positions
        causal = torch.ones(s, seen + s, dtype=torch.bool, device=x.device).tril(seen)  # key j <= query seen + i
        if past is None and real is None:
            # training: GPT-NeoX's form, the causal corner of proj over the positions 0..s-1
            weight = self.proj.weight[:s, :s].masked_fill(~causal, 0.0)
            mixed = torch.einsum("nm,bmf->bnf", weight, gate) + self.proj.bias[:s, None]
        else:
            weight = self.proj.weight[positions[:, :, None], key_positions[:, None, :]]  # [b, s, seen + s]
            mixed = torch.bmm(weight.masked_fill(~causal, 0.0), history[..., : gate.shape[-1]])
            mixed = mixed + self.proj.bias[positions].unsqueeze(-1)
        if self.attn is not None:
            allowed = causal.expand(b, s, seen + s)
            if attention_mask is not None:
                allowed = allowed & attention_mask[:, 0].bool().expand(b, s, seen + s)
            k, v = history[..., gate.shape[-1]:].chunk(2, dim=-1)
            mixed = mixed + self.attn(q, k, v, allowed)
        return mixed * res, (history, key_positions)


class GMLPBlock(Block):
    """GPT-NeoX's ``GMLPBlock`` (no residual around it: see the module doc)."""

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        super().__init__()
        name = f"layers.{layer_number}"
        self.layer_number = layer_number
        shape = gmlp_shape(config, config.attention_types[layer_number])
        ff = shape.ff
        self.norm = build_norm(config.norm_settings)
        self.input_linear = _ColumnWithoutBias(
            config.arch.hidden, 2 * ff, name=f"{name}.input_linear", init_fn=config.init_fn(), seed=config.seed,
            sections=[ff, ff], sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)
        self.activation = get_activation(config.activation).fn
        self.sgu = SpatialGatingUnit(config, ff, shape.seq, shape.attn_dim, f"{name}.sgu")
        self.output_linear = _RowWithoutBias(
            ff, config.arch.hidden, name=f"{name}.output_linear", init_fn=config.output_init_fn(), seed=config.seed,
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)
        for linear in (self.input_linear, self.output_linear):
            assert linear.bias is not None
            linear.bias.requires_grad_(False)  # never added, so never trained (GPT-NeoX's stay zero too)
        if config.sequence_parallel and get_tensor_model_parallel_world_size() > 1:
            mark_partial_over_tensor_parallel(self.norm.parameters())  # it sees a sequence shard

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        y_sbf = self.activation(self.input_linear(self.norm(x)))  # [s, b, 2ff/tp]
        past = None if kv_cache is None else kv_cache.layers.get(self.layer_number)
        real = real_tokens(attention_mask, y_sbf.shape[0])
        gated, state = self.sgu(y_sbf.transpose(0, 1), position_ids, attention_mask, real, past)  # [b, s, ff/tp]
        if kv_cache is not None:
            kv_cache.layers[self.layer_number] = state
        return self.output_linear(gated.transpose(0, 1))


__all__ = ["GMLPBlock", "SpatialGatingUnit", "TinyAttention"]
