"""The recurrences of the recurrent layer families, in PyTorch (the reference path, and what runs on CPU).

* :func:`linear_recurrence`: ``h_t = a_t * h_{t-1} + b_t`` elementwise (Mamba's selective scan), as a
  chunked parallel scan: inside a chunk of ``chunk`` steps a Hillis-Steele scan composes the affine maps
  in log2(chunk) tensor operations; the chunks are chained one after another. Only products of the
  decays (<= 1) are formed, never their inverses, so it is as stable as the sequential loop.
* :func:`wkv6`: RWKV-6's WKV, ``y_t = r_t (diag(u) k_t v_t^T + S_{t-1})``, ``S_t = diag(w_t) S_{t-1} + k_t v_t^T``
  per head, in chunks: within a chunk the pairwise decays ``prod_{j<m<t} w_m`` are formed explicitly
  (``[chunk, chunk, N]`` exponents, all <= 0, differences of fp64 partial sums of the log-decays so that
  strong decays early in a chunk cost no precision later in it), the state carries between chunks.

Both take an initial state and return the last one, so decoding continues where a prompt left off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCAN_CHUNK = 64
WKV_CHUNK = 16


def _hillis_steele(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of the affine maps ``h -> a_t h + b_t`` along dim 2: (prod a, state from zero)."""
    steps = a.shape[2]
    shift = 1
    while shift < steps:
        a_prev = F.pad(a[:, :, :-shift], (0, 0, shift, 0), value=1.0)
        b_prev = F.pad(b[:, :, :-shift], (0, 0, shift, 0), value=0.0)
        a, b = a * a_prev, a * b_prev + b
        shift *= 2
    return a, b


def linear_recurrence(a: torch.Tensor, b: torch.Tensor, state: torch.Tensor | None = None,
                      chunk: int = SCAN_CHUNK) -> torch.Tensor:
    """Every ``h_t = a_t * h_{t-1} + b_t`` for `a`, `b` `[batch, d, l, n]` along dim 2, from ``h_{-1} = state``
    `[batch, d, n]` (zeros when None) -> `[batch, d, l, n]`."""
    out = []
    carry = state
    for start in range(0, a.shape[2], chunk):
        prod, h = _hillis_steele(a[:, :, start:start + chunk], b[:, :, start:start + chunk])
        if carry is not None:
            h = h + prod * carry.unsqueeze(2).to(h.dtype)
        out.append(h)
        carry = h[:, :, -1]
    return torch.cat(out, dim=2)


def wkv6(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_w: torch.Tensor, u: torch.Tensor,
         state: torch.Tensor | None = None, chunk: int = WKV_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """RWKV-6's WKV in fp32 (fp64 for fp64 inputs): r, k, v, log_w `[b, t, H, N]` (log_w = log of the decay, <= 0), u `[H, N]`, state
    `[b, H, N, N]` (key channel x value channel; zeros when None) -> (y `[b, t, H, N]`, last state)."""
    b, t, heads, n = r.shape
    dtype = torch.promote_types(r.dtype, torch.float32)  # fp32, or fp64 for a float64 check
    r, k, v, log_w = (x.to(dtype) for x in (r, k, v, log_w))
    s = torch.zeros(b, heads, n, n, device=r.device, dtype=dtype) if state is None else state.to(dtype)
    outs = []
    for start in range(0, t, chunk):
        rc, kc, vc, wc = (x[:, start:start + chunk] for x in (r, k, v, log_w))  # [b, c, H, N]
        c = rc.shape[1]
        # log-decay from the chunk's start through step i (inclusive), and through i - 1: the same partial sums,
        # in fp64, so that a difference of two of them (a decay between two steps) loses nothing to cancellation
        g = wc.double().cumsum(dim=1)
        g_before = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        # from the state at the chunk's start
        y = torch.einsum("bchn,bhnm->bchm", rc * g_before.exp().to(dtype), s)
        # from the chunk's earlier steps j < i: sum_n r_i k_j exp(g_{i-1} - g_j), exponent <= 0
        earlier = torch.ones(c, c, dtype=torch.bool, device=r.device).tril(-1)  # [i, j]
        exponent = (g_before.unsqueeze(2) - g.unsqueeze(1)).masked_fill(~earlier[None, :, :, None, None], -torch.inf)
        scores = torch.einsum("bihn,bjhn,bijhn->bhij", rc, kc, exponent.exp().to(dtype))  # [b, H, i, j]
        y = y + torch.einsum("bhij,bjhm->bihm", scores, vc)
        # the step's own key/value, weighted by the bonus u
        y = y + (rc * u.to(dtype) * kc).sum(-1, keepdim=True) * vc
        outs.append(y)
        last = g[:, -1:]  # [b, 1, H, N]
        s = s * last.squeeze(1).exp().to(dtype).unsqueeze(-1)
        s = s + torch.einsum("bjhn,bjhm->bhnm", kc * (last - g).exp().to(dtype), vc)
    return torch.cat(outs, dim=1), s


def real_tokens(attention_mask: torch.Tensor | None, new_tokens: int) -> torch.Tensor | None:
    """`[b, new_tokens]` bool: which of this call's tokens are real (False: left padding), read from a decoding
    mask `[b, 1, q, k]` (True = may attend) as the keys the last query sees; None without a mask."""
    if attention_mask is None:
        return None
    return attention_mask[:, 0, -1, -new_tokens:].bool()
