"""Mamba layers as GPT-NeoX builds them (``megatron/model/mamba/mamba.py``, commit ea7aefd8), tensor-parallel.

One layer is ``x + mixer(norm(x))`` (``ParallelMambaResidualLayer``); the mixer (``ParallelMambaBlock``) is

    [x; z] = in_proj(h)                         column-parallel, rank r holds [x_r; z_r]
    x = silu(causal depthwise conv1d(x))        this rank's inner channels
    [dt; B; C] = x_proj(x)                      row-parallel, summed over ranks
    dt = dt_proj(dt)                            this rank's channels (+ bias, the softplus offset)
    y = selective_scan(x, dt, A = -exp(A_log), B, C, D) * silu(z)
    out = out_proj(y)                           row-parallel

with GPT-NeoX's parameter names, shapes and initialisation (``dt_proj`` uniform in +-dt_rank^-0.5, its
bias the inverse softplus of a log-uniform step in [1e-3, 0.1], ``A_log = log(1..16)``, ``D = 1``, the
convolution torch's default). One deliberate difference: GPT-NeoX does not sum ``x_proj``'s output over
tensor-parallel ranks (``parallel_output=True``), so its model at tp > 1 is a different function of the
same weights; Deepy sums it, so every layout computes the tp = 1 model (the parity tests require it).

The reference path is PyTorch (a chunked parallel scan); with ``mamba_selective_scan_fusion`` /
``mamba_causal_conv_fusion`` / ``mamba_inner_func_fusion`` the ``mamba_ssm`` and ``causal_conv1d`` CUDA
kernels run instead (the checks refuse these keys where the packages or a GPU are missing). Decoding keeps
``(convolution inputs [b, d/tp, 3], scan state [b, d/tp, 16])`` per layer in the ``KVCache``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.block import Block, fill_parameter_, layer_parameter, uniform
from megatron.model.config import GPTConfig
from megatron.model.family_config import mamba_shape
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.model.scans import linear_recurrence, real_tokens
from megatron.mpu.initialize_weights import InitFn
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, mark_partial_over_tensor_parallel
from megatron.mpu.mappings import copy_to_tensor_model_parallel_region
from megatron.mpu.topology import get_tensor_model_parallel_world_size

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4  # GPT-NeoX's (mamba_ssm's) step-size init range


def _dt_bias_init(t: torch.Tensor, gen: torch.Generator) -> None:
    """softplus^-1 of a step drawn log-uniformly in [DT_MIN, DT_MAX] (at least DT_FLOOR)."""
    u = torch.rand(t.shape, generator=gen)
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
    t.copy_(dt + torch.log(-torch.expm1(-dt)))


def _a_log_init(t: torch.Tensor, gen: torch.Generator) -> None:
    """S4D-real: A_log[d, n] = log(n + 1)."""
    t.copy_(torch.log(torch.arange(1, t.shape[1] + 1, dtype=torch.float32)).expand(t.shape))


def _ones(t: torch.Tensor, gen: torch.Generator) -> None:
    t.fill_(1.0)


def selective_scan(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    z: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's selective scan in fp32: u, dt, z `[b, d, l]`, A `[d, n]`, B, C `[b, n, l]`, D, dt_bias `[d]`,
    state `[b, d, n]` (zeros when None) -> (y `[b, d, l]` in u's dtype, last state `[b, d, n]`).

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t;  y_t = C_t . h_t + D u_t, times silu(z_t); dt = softplus(dt + bias)."""
    delta = F.softplus(dt.float() + dt_bias.float()[None, :, None])  # [b, d, l]
    decay = torch.exp(delta.unsqueeze(-1) * A.float()[None, :, None, :])  # [b, d, l, n]
    drive = (delta * u.float()).unsqueeze(-1) * B.float().transpose(1, 2).unsqueeze(1)  # [b, d, l, n]
    states = linear_recurrence(decay, drive, state)  # [b, d, l, n]
    y = (states * C.float().transpose(1, 2).unsqueeze(1)).sum(-1)  # [b, d, l]
    y = (y + u.float() * D.float()[None, :, None]) * F.silu(z.float())
    return y.to(u.dtype), states[:, :, -1]


class MambaMixer(nn.Module):
    """GPT-NeoX's ``ParallelMambaBlock``: hidden `[s, b, h]` -> `[s, b, h]` (this rank's inner channels inside)."""

    def __init__(self, config: GPTConfig, name: str) -> None:
        super().__init__()
        shape = mamba_shape(config)
        self.shape = shape
        h, d, r, n, k = shape.hidden, shape.inner, shape.dt_rank, shape.state, shape.conv
        tp = get_tensor_model_parallel_world_size()
        self.inner_per_rank = d // tp
        bias = config.mamba_use_bias_in_linears
        self.fused_scan = config.mamba_selective_scan_fusion
        self.fused_conv = config.mamba_causal_conv_fusion
        self.fused_inner = config.mamba_inner_func_fusion
        seed, dtype = config.seed, config.params_dtype
        self.in_proj = ColumnParallelLinear(h, 2 * d, name=f"{name}.in_proj", init_fn=config.init_fn(),
                                            bias=bias, sections=[d, d], sequence_parallel=config.sequence_parallel,
                                            seed=seed, params_dtype=dtype)
        local = self.inner_per_rank
        self.conv1d = nn.Conv1d(local, local, k, groups=local, padding=k - 1, bias=config.mamba_use_bias_in_conv,
                                dtype=config.params_dtype)
        conv_init: InitFn = uniform(1.0 / math.sqrt(k))  # torch's Conv1d default: fan_in = 1 channel x k taps
        fill_parameter_(self.conv1d.weight, (d, 1, k), name=f"{name}.conv1d.weight", seed=config.seed,
                        init_fn=conv_init, dim=0)
        if self.conv1d.bias is not None:
            fill_parameter_(self.conv1d.bias, (d,), name=f"{name}.conv1d.bias", seed=config.seed, init_fn=conv_init,
                            dim=0)
        self.x_proj = RowParallelLinear(d, r + 2 * n, name=f"{name}.x_proj", init_fn=config.init_fn(), bias=bias,
                                        seed=seed, params_dtype=dtype)
        self.dt_proj = nn.Linear(r, local, bias=True, dtype=config.params_dtype)
        fill_parameter_(self.dt_proj.weight, (d, r), name=f"{name}.dt_proj.weight", seed=config.seed,
                        init_fn=uniform(r**-0.5), dim=0)
        fill_parameter_(self.dt_proj.bias, (d,), name=f"{name}.dt_proj.bias", seed=config.seed,
                        init_fn=_dt_bias_init, dim=0)
        # mamba_selective_fp32_params: A_log and D kept in fp32 (GPT-NeoX marks them _deepspeed_no_cast), else in the
        # model's dtype like every other weight; the scan reads them in fp32 whatever they are stored in
        kept = torch.float32 if config.mamba_selective_fp32_params else config.params_dtype
        self.A_log = layer_parameter((d, n), name=f"{name}.A_log", seed=config.seed, init_fn=_a_log_init, dim=0,
                                     dtype=kept)
        self.D = layer_parameter((d,), name=f"{name}.D", seed=config.seed, init_fn=_ones, dim=0, dtype=kept)
        for param in (self.A_log, self.D):
            param.no_weight_decay = True  # type: ignore[attr-defined]  # GPT-NeoX's _no_weight_decay, read by the optimizer
        self.out_proj = RowParallelLinear(d, h, name=f"{name}.out_proj", init_fn=config.output_init_fn(), bias=bias,
                                          sequence_parallel=config.sequence_parallel, seed=seed, params_dtype=dtype)

    def forward(self, x_sbh: torch.Tensor, real: torch.Tensor | None = None,
                state: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`real`: `[b, s]` bool, False for left padding (kept out of the state); `state`: the decoding state
        so far. Returns the output `[s, b, h]` and the state after these tokens."""
        xz = self.in_proj(x_sbh).permute(1, 2, 0)  # [b, 2d/tp, s] (the whole sequence under sequence parallelism)
        A = -torch.exp(self.A_log.float())  # [d/tp, n]
        if self.fused_inner and state is None and real is None:
            return self._fused_inner(xz, A), self._empty_state(xz)
        x, z = xz.chunk(2, dim=1)  # [b, d/tp, s] each
        if real is not None:
            x = x * real[:, None, :].to(x.dtype)
        x, conv_state = self._conv(x, None if state is None else state[0])
        if real is not None:
            x = x * real[:, None, :].to(x.dtype)
        # B, C and the step size come from every inner channel: sum the ranks' parts, and the gradient too
        x_dbl = copy_to_tensor_model_parallel_region(self.x_proj(x.transpose(1, 2)))  # [b, s, r + 2n]
        dt, B, C = x_dbl.split([self.shape.dt_rank, self.shape.state, self.shape.state], dim=-1)
        dt_bdl = (dt @ self.dt_proj.weight.t()).transpose(1, 2)  # [b, d/tp, s]
        y, ssm_state = self._scan(x, dt_bdl, A, B.transpose(1, 2), C.transpose(1, 2), z,
                                  None if state is None else state[1])
        out = self.out_proj(y.permute(2, 0, 1))  # [s, b, h] (a sequence shard under sp)
        return out, (conv_state, ssm_state)

    def _conv(self, x: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(causal depthwise conv) of `[b, d/tp, s]`, after the `k - 1` inputs of ``past`` (zeros if None)."""
        k = self.shape.conv
        s = x.shape[-1]
        weight, bias = self.conv1d.weight.to(x.dtype), self.conv1d.bias
        if past is None and self.fused_conv:
            # lazy: causal-conv1d's kernel is optional
            from causal_conv1d import causal_conv1d_fn

            y = causal_conv1d_fn(x, weight.squeeze(1), None if bias is None else bias.to(x.dtype), activation="silu")
            return y, F.pad(x, (k - 1, 0))[..., -(k - 1):]
        history = torch.zeros(*x.shape[:2], k - 1, dtype=x.dtype, device=x.device) if past is None else past.to(x.dtype)
        full = torch.cat([history, x], dim=-1)  # [b, d/tp, k - 1 + s]
        y = F.conv1d(full, weight, None if bias is None else bias.to(x.dtype), groups=x.shape[1])  # [b, d/tp, s]
        return F.silu(y[..., -s:]), full[..., -(k - 1):]

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              z: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_scan and state is None:
            # lazy: mamba-ssm's kernels are optional
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

            y, last = selective_scan_fn(x, dt, A, B.contiguous(), C.contiguous(), self.D.float(), z=z,
                                        delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                                        return_last_state=True)
            return y, last
        return selective_scan(x, dt, A, B, C, self.D, z, self.dt_proj.bias, state)

    def _fused_inner(self, xz: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """mamba_ssm's whole-mixer function (one tensor-parallel rank, no projection biases: the checks say so)."""
        # lazy: mamba-ssm's kernels are optional
        from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn

        bias = self.conv1d.bias
        out = mamba_inner_fn(xz, self.conv1d.weight, None if bias is None else bias.to(xz.dtype), self.x_proj.weight,
                             self.dt_proj.weight, self.out_proj.weight, None, A, None, None, self.D.float(),
                             delta_bias=self.dt_proj.bias.float(), delta_softplus=True)  # [b, s, h]
        return out.transpose(0, 1)

    def _empty_state(self, xz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = xz.shape[0]
        return (xz.new_zeros(b, self.inner_per_rank, self.shape.conv - 1),
                xz.new_zeros(b, self.inner_per_rank, self.shape.state, dtype=torch.float32))


class MambaLayer(Block):
    """GPT-NeoX's ``ParallelMambaResidualLayer``: ``x + mixer(norm(x))``."""

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.norm = build_norm(config.norm_settings)
        self.mixer = MambaMixer(config, f"layers.{layer_number}.mixer")
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
        state = None if kv_cache is None else kv_cache.layers.get(self.layer_number)
        out, new_state = self.mixer(self.norm(x), real_tokens(attention_mask, x.shape[0]), state)
        if kv_cache is not None:
            kv_cache.layers[self.layer_number] = new_state
        return x + out


__all__ = ["MambaLayer", "MambaMixer", "selective_scan"]
