"""RWKV-6 ("Finch") layers as GPT-NeoX builds them (``megatron/model/rwkv/v6/rwkv.py``, commit ea7aefd8).

One layer (``RWKVResidualLayer``) is ``x = x + att(ln1(x))``, then ``x = x + ffn(ln2(x))``; layer 0 first
applies ``ln1`` to its input once more (GPT-NeoX reuses ``ln1`` where RWKV has a separate ``ln0``). The
norms are torch LayerNorms whatever ``norm`` says (the final norm follows ``norm``). With dropout set,
``drop0``/``drop1`` apply to the sums, as GPT-NeoX does.

* time mix (``RWKV_TimeMix``): data-dependent token shift (five rank-32 mixers), receptance/key/value/
  gate projections, a data-dependent decay ``w = time_decay + tanh(x W1) W2`` (decay per step
  ``exp(-exp(w))``), the WKV recurrence with bonus ``time_faaaa``, a per-head GroupNorm, ``output(. * silu(g))``;
* channel mix (``RWKV_ChannelMix``): ``sigmoid(receptance(xr)) * value(relu(key(xk))^2)``.

Parameter names, shapes and initialisation are GPT-NeoX's (the ratios-of-depth formulas for the mixers,
decays and bonus; U(+-1e-4) for the low-rank mixers; torch's default for the projections, which GPT-NeoX
leaves at it). Two differences, both where GPT-NeoX's layer does not do what RWKV means: the layer
receives ``[s, b, h]`` there and treats it as ``[batch, time, channels]``, so its token shift and WKV run
over the batch axis; here they run over time. And GPT-NeoX's WKV is a CUDA kernel that asserts bf16; the
reference here is :func:`megatron.model.scans.wkv6` (fp32), and ``rwkv_wkv_fusion`` runs
``flash-linear-attention``'s kernel. GPT-NeoX has no tensor-parallel RWKV: every tensor-parallel rank holds
the whole layer and computes the same thing. Decoding keeps ``(last inputs of the two token shifts
[b, 2, h], WKV state [b, H, N, N])`` per layer in the ``KVCache``.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.block import Block, fill_parameter_, layer_parameter, torch_linear_default, uniform
from megatron.model.config import GPTConfig
from megatron.model.family_config import RWKV_TIME_DECAY_RANK, RWKV_TIME_MIX_RANK, rwkv_shape
from megatron.model.kv_cache import KVCache
from megatron.model.scans import real_tokens, wkv6
from megatron.mpu.initialize_weights import InitFn

LN_X_EPS = 1e-5 * 8**2  # GPT-NeoX's GroupNorm epsilon (head_size_divisor 8, squared)


def _values(values: torch.Tensor) -> InitFn:
    """Fill with fixed values (GPT-NeoX's depth-dependent formulas draw nothing at random)."""

    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        t.copy_(values.reshape(t.shape))

    return init


def _linear(in_features: int, out_features: int, name: str, config: GPTConfig) -> nn.Linear:
    """A replicated ``nn.Linear`` without bias, initialised as torch does, drawn from (seed, name)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=config.params_dtype)
    fill_parameter_(layer.weight, (out_features, in_features), name=f"{name}.weight", seed=config.seed,
                    init_fn=torch_linear_default(in_features))
    return layer


def _shift(x: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """`[b, t, h]` moved one step later in time; the first step sees ``previous`` `[b, h]` (zeros when None)."""
    first = torch.zeros_like(x[:, :1]) if previous is None else previous.unsqueeze(1).to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


class TimeMix(nn.Module):
    """GPT-NeoX's ``RWKV_TimeMix``: `[b, t, h]` -> `[b, t, h]`."""

    def __init__(self, config: GPTConfig, layer_number: int, name: str) -> None:
        super().__init__()
        shape = rwkv_shape(config)
        self.shape = shape
        self.fused = config.rwkv_wkv_fusion
        h, a, layers = shape.hidden, shape.dim_att, config.arch.layers
        ratio_0_to_1 = layer_number / (layers - 1) if layers > 1 else 0.0
        ratio_1_to_almost0 = 1.0 - layer_number / layers
        ddd = torch.arange(h, dtype=torch.float32) / h

        def param(field: str, full_shape: tuple[int, ...], init: InitFn) -> nn.Parameter:
            return layer_parameter(full_shape, name=f"{name}.{field}", seed=config.seed, init_fn=init,
                                   dtype=config.params_dtype)

        mix = 1.0 - ddd.pow(ratio_1_to_almost0)
        half = 1.0 - ddd.pow(0.5 * ratio_1_to_almost0)
        self.time_maa_x = param("time_maa_x", (1, 1, h), _values(mix))
        self.time_maa_w = param("time_maa_w", (1, 1, h), _values(mix))
        self.time_maa_k = param("time_maa_k", (1, 1, h), _values(mix))
        self.time_maa_v = param("time_maa_v", (1, 1, h),
                                _values(1.0 - (ddd.pow(ratio_1_to_almost0) + 0.3 * ratio_0_to_1)))
        self.time_maa_r = param("time_maa_r", (1, 1, h), _values(half))
        self.time_maa_g = param("time_maa_g", (1, 1, h), _values(half))
        small = uniform(1e-4)
        self.time_maa_w1 = param("time_maa_w1", (h, 5 * RWKV_TIME_MIX_RANK), small)
        self.time_maa_w2 = param("time_maa_w2", (5, RWKV_TIME_MIX_RANK, h), small)
        n = torch.arange(a, dtype=torch.float32)
        speed = -6 + 5 * (n / max(a - 1, 1)).pow(0.7 + 1.3 * ratio_0_to_1)
        self.time_decay = param("time_decay", (1, 1, a), _values(speed))
        self.time_decay_w1 = param("time_decay_w1", (h, RWKV_TIME_DECAY_RANK), small)
        self.time_decay_w2 = param("time_decay_w2", (RWKV_TIME_DECAY_RANK, a), small)
        zigzag = ((n + 1) % 3 - 1) * 0.1
        bonus = ratio_0_to_1 * (1 - n / max(a - 1, 1)) + zigzag
        self.time_faaaa = param("time_faaaa", (shape.heads, shape.head_size), _values(bonus))
        self.receptance = _linear(h, a, f"{name}.receptance", config)
        self.key = _linear(h, a, f"{name}.key", config)
        self.value = _linear(h, a, f"{name}.value", config)
        self.output = _linear(a, h, f"{name}.output", config)
        self.gate = _linear(h, a, f"{name}.gate", config)
        self.ln_x = nn.GroupNorm(shape.heads, a, eps=LN_X_EPS, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None, state: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[b, t, h]`; ``previous`` `[b, h]` the input before x's first step; ``state`` the WKV state."""
        b, t, _ = x.shape
        xx = _shift(x, previous) - x
        xxx = x + xx * self.time_maa_x
        xxx = torch.tanh(xxx @ self.time_maa_w1).view(b * t, 5, -1).transpose(0, 1)  # [5, b*t, 32]
        mw, mk, mv, mr, mg = torch.bmm(xxx, self.time_maa_w2).view(5, b, t, -1).unbind(0)
        r = self.receptance(x + xx * (self.time_maa_r + mr))  # [b, t, a]
        k = self.key(x + xx * (self.time_maa_k + mk))
        v = self.value(x + xx * (self.time_maa_v + mv))
        g = F.silu(self.gate(x + xx * (self.time_maa_g + mg)))
        w = self.time_decay + torch.tanh((x + xx * (self.time_maa_w + mw)) @ self.time_decay_w1) @ self.time_decay_w2
        heads, n = self.shape.heads, self.shape.head_size
        split = (b, t, heads, n)
        log_w = -torch.exp(w.to(torch.promote_types(w.dtype, torch.float32)))  # log of the per-step decay
        y, state = self._wkv(r.view(split), k.view(split), v.view(split), log_w.view(split), state)
        y = self.ln_x(y.reshape(b * t, -1).to(x.dtype)).view(b, t, -1)
        return self.output(y * g), state

    def _wkv(self, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_w: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused and r.is_cuda:
            # flash-linear-attention (requirements-kernels.txt) installs the import name `fla`, which a
            # requirements scan cannot tie to it without the package present: imported by module name
            chunk_rwkv6 = importlib.import_module("fla.ops.rwkv6").chunk_rwkv6

            y, last = chunk_rwkv6(r, k, v, log_w.to(r.dtype), self.time_faaaa.to(r.dtype), scale=1.0,
                                  initial_state=state, output_final_state=True)
            return y, last
        return wkv6(r, k, v, log_w, self.time_faaaa, state)


class ChannelMix(nn.Module):
    """GPT-NeoX's ``RWKV_ChannelMix``: `[b, t, h]` -> `[b, t, h]`."""

    def __init__(self, config: GPTConfig, layer_number: int, name: str) -> None:
        super().__init__()
        shape = rwkv_shape(config)
        h = shape.hidden
        ddd = torch.arange(h, dtype=torch.float32) / h
        mix = 1.0 - ddd.pow(1.0 - layer_number / config.arch.layers)
        self.time_maa_k = layer_parameter((1, 1, h), name=f"{name}.time_maa_k", seed=config.seed,
                                          init_fn=_values(mix), dtype=config.params_dtype)
        self.time_maa_r = layer_parameter((1, 1, h), name=f"{name}.time_maa_r", seed=config.seed,
                                          init_fn=_values(mix), dtype=config.params_dtype)
        self.key = _linear(h, shape.ffn, f"{name}.key", config)
        self.receptance = _linear(h, h, f"{name}.receptance", config)
        self.value = _linear(shape.ffn, h, f"{name}.value", config)

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        xx = _shift(x, previous) - x
        k = torch.relu(self.key(x + xx * self.time_maa_k)) ** 2
        return torch.sigmoid(self.receptance(x + xx * self.time_maa_r)) * self.value(k)


class RWKVLayer(Block):
    """GPT-NeoX's ``RWKVResidualLayer`` on Deepy's `[s, b, h]` hidden states."""

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        super().__init__()
        name = f"layers.{layer_number}"
        self.layer_number = layer_number
        h = config.arch.hidden
        self.ln1 = nn.LayerNorm(h, dtype=config.params_dtype)
        self.ln2 = nn.LayerNorm(h, dtype=config.params_dtype)
        self.att = TimeMix(config, layer_number, f"{name}.att")
        self.ffn = ChannelMix(config, layer_number, f"{name}.ffn")
        self.attention_dropout = config.attention_dropout
        self.hidden_dropout = config.hidden_dropout

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        x_bth = x.transpose(0, 1)
        state = None if kv_cache is None else kv_cache.layers.get(self.layer_number)
        shifts, wkv_state = (None, None) if state is None else state
        real = real_tokens(attention_mask, x.shape[0])
        if self.layer_number == 0:
            x_bth = self.ln1(x_bth)
        att_in = self._only_real(self.ln1(x_bth), real)
        att_out, wkv_state = self.att(att_in, None if shifts is None else shifts[:, 0], wkv_state)
        x_bth = self._drop(x_bth + att_out, self.attention_dropout)
        ffn_in = self._only_real(self.ln2(x_bth), real)
        x_bth = self._drop(x_bth + self.ffn(ffn_in, None if shifts is None else shifts[:, 1]), self.hidden_dropout)
        if kv_cache is not None:
            kv_cache.layers[self.layer_number] = (torch.stack([att_in[:, -1], ffn_in[:, -1]], dim=1), wkv_state)
        return x_bth.transpose(0, 1).contiguous()  # [s, b, h] (a pipeline stage sends it as is)

    @staticmethod
    def _only_real(x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """Left padding enters the token shift and the recurrence as zeros, i.e. not at all."""
        return x if real is None else x * real.unsqueeze(-1).to(x.dtype)

    def _drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        return F.dropout(x, p, training=True) if self.training and p > 0 else x
