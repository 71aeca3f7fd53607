"""Causal self-attention: fused column-parallel QKV, SDPA, row-parallel output.

Heads are split across tp ranks. The fused QKV weight is `[q; k; v]` along its rows
(`num_attention_heads*d`, `num_kv_heads*d`, `num_kv_heads*d`); rank r holds
`[q_r; k_r; v_r]`, its own query heads and the key/value heads they read (grouped-query
attention: query head i reads kv head i // (heads / kv_heads)).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.documents import attend_per_document
from megatron.model.kv_cache import KVCache
from megatron.model.norm_layers import TensorParallelRMSNorm
from megatron.model.norms import build_norm
from megatron.model.positional import RelativePositionBias, RotaryEmbedding, alibi_bias, alibi_slopes
from megatron.model.softcap import soft_cap
from megatron.mpu.context_parallel import heads_to_sequence, sequence_to_heads
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, mark_partial_over_tensor_parallel
from megatron.mpu.random import tensor_parallel_rng
from megatron.mpu.topology import (
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, name: str, layer_number: int = 0) -> None:
        super().__init__()
        self.layer_number = layer_number
        tp = get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.head_dim = config.head_dim
        self.heads = config.arch.heads // tp  # on this rank
        self.kv_heads = config.kv_heads // tp
        sections = [config.arch.heads * self.head_dim] + [config.kv_heads * self.head_dim] * 2
        self.query_key_value = ColumnParallelLinear(
            config.arch.hidden,
            sum(sections),
            name=f"{name}.query_key_value",
            init_fn=config.init_fn(),
            seed=config.seed,
            bias=config.qkv_bias,
            sections=sections,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )
        self.dense = RowParallelLinear(
            config.arch.heads * self.head_dim,
            config.arch.hidden,
            name=f"{name}.dense",
            init_fn=config.output_init_fn(),
            seed=config.seed,
            bias=config.use_bias_in_attn_linear,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )
        # qk_norm_scope projection (OLMo 2): one RMSNorm over each whole projection, its gains split with the heads
        self.qk_norm_over_projection = config.use_qk_layernorm and config.qk_norm_scope == "projection"
        if self.qk_norm_over_projection:
            eps, dtype = config.rms_norm_epsilon, config.params_dtype
            self.q_norm: nn.Module | None = TensorParallelRMSNorm(config.arch.heads * self.head_dim, eps, dtype)
            self.k_norm: nn.Module | None = TensorParallelRMSNorm(config.kv_heads * self.head_dim, eps, dtype)
        elif config.use_qk_layernorm:
            # one norm over the head dim, shared by all heads; heads are split, so grads are partial
            self.q_norm = build_norm(config.norm_settings, self.head_dim)
            self.k_norm = build_norm(config.norm_settings, self.head_dim)
            mark_partial_over_tensor_parallel([*self.q_norm.parameters(), *self.k_norm.parameters()])
        else:
            self.q_norm = self.k_norm = None
        self.rotary = (
            RotaryEmbedding(config.rotary_dim, config.rotary_base(layer_number), config.rotary_save_freqs_buffer,
                            config.rotary_scaling(layer_number), config.max_positions)
            if config.pos_emb == "rotary"
            else None
        )
        if config.pos_emb == "alibi":
            rank = get_tensor_model_parallel_rank()
            slopes = alibi_slopes(config.arch.heads)[rank * self.heads : (rank + 1) * self.heads]
            self.register_buffer("alibi_slopes", slopes, persistent=False)
        else:
            self.alibi_slopes = None
        self.relative_position_bias = (
            RelativePositionBias(config, f"{name}.relative_position_bias") if config.pos_emb == "rpe" else None
        )
        self.context_parallel = get_context_parallel_world_size()
        if self.context_parallel > 1 and (self.heads % self.context_parallel or self.kv_heads % self.context_parallel):
            raise ModelConfigError(
                f"context parallelism over {self.context_parallel} ranks splits each tensor-parallel rank's "
                f"{self.heads} query and {self.kv_heads} key/value heads between them: both must be multiples"
            )
        if self.context_parallel > 1 and config.pos_emb == "rpe":
            raise ModelConfigError("pos_emb rpe is not supported with context parallelism yet")
        if self.context_parallel > 1 and self.alibi_slopes is not None:
            # attention runs on this context-parallel rank's share of the heads (megatron/mpu/context_parallel.py)
            share, cp_rank = self.heads // self.context_parallel, get_context_parallel_rank()
            self.alibi_slopes = self.alibi_slopes[cp_rank * share : (cp_rank + 1) * share].clone()
        self.window = config.attention_window(layer_number)
        # GPT-2's inverse-layer option divides the scores by (layer + 1): the divisor is a tensor, not a
        # Python float, because torch.compile specialises on a float attribute and would compile one
        # graph per layer (and run the layers past its recompile limit uncompiled). An integer buffer:
        # the engine's bf16/fp16 cast of the module leaves it exact.
        self.inverse_layer: torch.Tensor | None
        if config.scale_attn_by_inverse_layer_idx:
            self.register_buffer("inverse_layer", torch.tensor(layer_number + 1), persistent=False)
        else:
            self.inverse_layer = None
        self.dropout = config.attention_dropout
        # muP: scores q.k / d (GPT-NeoX's norm_factor = head_dim) over mup_attn_temp; None: SDPA's 1 / sqrt(d)
        self.softmax_scale = 1.0 / (self.head_dim * config.mup_attn_temp) if config.use_mup else None
        if config.query_pre_attn_scalar is not None:  # Gemma 2/3 (muP's scale is refused with it before launch)
            self.softmax_scale = config.query_pre_attn_scalar**-0.5
        self.logit_softcap = config.attn_logit_softcapping  # Gemma 2: c * tanh(scores / c)
        # Batch-first inside the block (the hidden states stay [s, b, h] outside): the projection then
        # writes q, k, v in the order SDPA reads fastest (the seq-first views took 5-30% longer for
        # the attention block on CPU). Sequence parallelism gathers and scatters along the sequence
        # dim around the projections, so it keeps them sequence-first.
        self.batch_first = not self.query_key_value.sequence_parallel

    def forward(
        self,
        x_sbh: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`document_ids` `[b, s]`: tokens attend only within their own document (packed samples,
        `megatron/model/documents.py`); None = one sequence per row."""
        # [b, s, (heads + 2 kv_heads) * d] (or [s, b, ...]), this rank's heads
        qkv = self.query_key_value(x_sbh.transpose(0, 1) if self.batch_first else x_sbh)
        b, s = qkv.shape[:2] if self.batch_first else (qkv.shape[1], qkv.shape[0])
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        if self.qk_norm_over_projection and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over this rank's heads, the squares summed over all ranks'
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if not self.qk_norm_over_projection and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, signed_sin = self.rotary.tables(position_ids, s, q.device)  # once for q and k
            q, k = self.rotary.rotate(q, cos, signed_sin), self.rotary.rotate(k, cos, signed_sin)
        if self.inverse_layer is not None:  # scores / (layer + 1), computed in fp32 and rounded once
            q = (q.float() / self.inverse_layer).to(q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        if self.context_parallel > 1:  # this rank's piece of the sequence -> a share of the heads, all of it
            if kv_cache is not None or attention_mask is not None:
                raise ModelConfigError("context parallelism runs training and evaluation forwards only")
            cp = self.context_parallel
            q, k, v = sequence_to_heads(q, cp), sequence_to_heads(k, cp), sequence_to_heads(v, cp)  # [b, n/cp, s*cp, d]
        if document_ids is not None:
            if kv_cache is not None or attention_mask is not None:
                raise ModelConfigError("document_ids cannot be combined with a kv_cache or an attention_mask")

            def alone(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:  # one document
                return self._attend(q_, k_, v_, self._mask(q_.shape[2], 0, None, q_), dropout_p)

            out = attend_per_document(q, k, v, document_ids, alone)  # [b, n, s, d]
        else:
            past = 0
            if kv_cache is not None:  # earlier tokens' keys/values come first
                past = kv_cache.past_length(self.layer_number)
                k, v = kv_cache.append(self.layer_number, k, v)  # [b, n_kv, past + s, d]
            out = self._attend(q, k, v, self._mask(q.shape[2], past, attention_mask, q), dropout_p)  # [b, n, s, d]
        out = heads_to_sequence(out, self.context_parallel)  # [b, n, s, d] of this rank's piece
        if self.batch_first:
            out = out.transpose(1, 2).reshape(b, s, self.heads * d)  # [b, s, n*d]
            return self.dense(out).transpose(0, 1)  # [s, b, h], a view
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads * d)  # [s, b, n*d]
        return self.dense(out)  # [s, b, h]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
    ) -> torch.Tensor:
        """SDPA of `q` `[b, n, s, d]` over `k`, `v` `[b, n_kv, past + s, d]` with `mask` from `_mask`."""
        if self.logit_softcap is not None:
            return self._attend_capped(q, k, v, mask, dropout_p)
        grouped = self.kv_heads != self.heads
        if grouped and mask is not None:
            # SDPA's grouped-query path (enable_gqa) exists in the flash and math kernels only, and flash
            # takes no mask: with one, GQA would fall back to the math kernel and materialise the
            # [b, n, s, s] scores. Repeating each kv head for its queries lets the memory-efficient
            # kernel take it (query head i reads kv head i // (n / n_kv), as repeat_interleave lays out).
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)  # [b, n, past + s, d]
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            grouped = False
        # heads differ per rank, so their dropout should too (no RNG switch without dropout: it
        # would only cost a graph break under torch.compile)
        with tensor_parallel_rng() if dropout_p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=grouped,  # query head i reads kv head i // (n / n_kv)
            )  # [b, n, s, d]

    def _attend_capped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
    ) -> torch.Tensor:
        """``_attend`` with soft-capped scores, which SDPA cannot take: scores scaled, capped, masked, softmax
        in fp32 and back to q's dtype (transformers 5.23.0 models/gemma2/modeling_gemma2.py:193-205)."""
        s, keys = q.shape[2], k.shape[2]
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)  # [b, n, past + s, d]
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scale = self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5
        scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, self.logit_softcap)  # [b, n, s, past + s]
        if mask is None:  # plain causal, nothing cached
            mask = torch.ones(s, keys, dtype=torch.bool, device=q.device).tril(keys - s)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # as HF: a row all masked stays finite
        else:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if dropout_p > 0:
            with tensor_parallel_rng():
                probs = F.dropout(probs, dropout_p, training=True)
        return torch.matmul(probs, v)  # [b, n, s, d]

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """`[b, s, n*d]` (or `[s, b, n*d]`) -> `[b, n, s, d]`, a view."""
        t = t.unflatten(-1, (n, self.head_dim))
        return t.transpose(1, 2) if self.batch_first else t.permute(1, 2, 0, 3)

    def _mask(
        self, s: int, past: int, attention_mask: torch.Tensor | None, q: torch.Tensor
    ) -> torch.Tensor | None:
        """None (plain causal: SDPA's ``is_causal``, which the flash kernel takes) or a mask for SDPA
        over keys `[0, past + s)`: bool (True = attend) or additive float (ALiBi, relative position
        bias). Query i sits at position past + i.

        A sliding window at least as long as the sequence changes nothing (no key is further back than
        it from any later query), so e.g. Mistral's 4096-token window at seq_length 4096 stays causal
        and keeps the flash kernel."""
        window = self.window if self.window is not None and past + s - 1 > self.window else None
        plain_causal = window is None and self.alibi_slopes is None and self.relative_position_bias is None
        if past == 0 and plain_causal and attention_mask is None:
            return None
        query_pos = torch.arange(past, past + s, device=q.device)
        key_pos = torch.arange(past + s, device=q.device)
        distance = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)  # [s, past + s]
        allowed = distance >= 0
        if window is not None:
            allowed = allowed & (distance <= window)
        if attention_mask is not None:
            allowed = allowed & attention_mask.to(torch.bool)  # broadcast to [b, 1, s, past + s]
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes.float(), distance)  # [n, s, past + s]
        elif self.relative_position_bias is not None:
            bias = self.relative_position_bias(distance)  # [n, s, past + s]
        else:
            return allowed
        return bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
