"""Positional information: absolute tables (learned, sinusoidal), rotary, ALiBi slopes/bias.

Absolute embeddings are added to the token embedding; rotary and ALiBi act inside attention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.model.config import GPTConfig
from megatron.model.rope_scaling import RopeScaling, dynamic_inv_freq, static_frequencies
from megatron.mpu.initialize_weights import initialize_param_, set_tensor_model_parallel_attributes
from megatron.mpu.topology import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from megatron.torch_internals import tensor_version


def default_position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """`[1, s]` positions 0..s-1 for tokens `[b, s]` (broadcasts over the batch)."""
    return torch.arange(tokens.shape[-1], device=tokens.device).unsqueeze(0)


# --- absolute --------------------------------------------------------------------------------
class LearnedPositionalEmbedding(nn.Module):
    """A trained table of `max_position_embeddings` vectors, replicated on every tp rank."""

    def __init__(self, config: GPTConfig, name: str) -> None:
        super().__init__()
        self.offset = config.opt_pos_emb_offset
        # GPT-NeoX: max_position_embeddings rows; the offset shifts positions inside the table
        shape = (config.max_positions, config.arch.hidden)
        self.weight = nn.Parameter(torch.empty(shape, dtype=config.params_dtype))
        initialize_param_(self.weight, f"{name}.weight", config.seed, config.init_fn(), shape)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[position_ids + self.offset]  # [b, s, h]


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed [sin(p * f_i), cos(p * f_i)] features, f_i = base^(-2i/h)."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, config: GPTConfig, name: str, base: float = 10000.0) -> None:
        super().__init__()
        del name  # no parameters to initialise
        dim = config.arch.hidden
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dim = dim

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids.float().unsqueeze(-1) * self.inv_freq  # [b, s, h/2]
        table = torch.cat([angles.sin(), angles.cos()], dim=-1)  # [b, s, h]
        return table[..., : self.dim]


# which pos_emb values add one of these tables to the token embedding: transformer_options.POSITIONAL

# --- rotary ----------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` dims of each head by position-dependent angles.

    Half-split layout: dim i pairs with dim i + rotary_dim/2 (GPT-NeoX's layout). The angles'
    cos/sin for the default positions 0..s-1 are computed once and reused by every call (every
    layer, query and key, every step) until the sequence length, the device or `inv_freq` changes.
    `scaling` (HF's rope_scaling kinds, `megatron/model/rope_scaling.py`) changes the frequencies,
    and for yarn multiplies cos/sin; `dynamic` recomputes them per call from the positions seen.
    """

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, rotary_dim: int, base: float, save_freqs: bool = False, scaling: RopeScaling | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        inv_freq, self.attention_factor = static_frequencies(inv_freq, float(base), rotary_dim, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=save_freqs)
        self.rotary_dim, self.base = rotary_dim, float(base)
        self.dynamic = scaling if scaling is not None and scaling.rope_type == "dynamic" else None
        self.max_positions = max_positions
        if self.dynamic is not None and max_positions is None:
            raise ValueError("dynamic rope scaling needs max_position_embeddings")
        self._cached: tuple[tuple[int, torch.device, int, int], torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[b|1, 1, s, rotary_dim]` for positions `[b|1, s]`."""
        inv_freq = self.inv_freq
        if self.dynamic is not None and self.max_positions is not None:
            length = int(position_ids.max()) + 1  # the frequencies follow the longest position seen
            if length > self.max_positions:
                inv_freq = dynamic_inv_freq(self.base, self.rotary_dim, self.dynamic.factor, length,
                                            self.max_positions, inv_freq.device)
        angles = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, r/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [b, 1, s, r]
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()

    def tables(self, position_ids: torch.Tensor | None, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `position_ids` `[b|1, s]`, or for 0..seq-1 when None (cached).

        The signed sin is `[-sin, sin]` over the two halves, so rotating is
        `x * cos + swap_halves(x) * signed_sin` (no negation pass)."""
        # under torch.compile the tables are computed inline (fused, and no Python state to guard on);
        # the key notices a new length or device and a reloaded or converted inv_freq
        cacheable = position_ids is None and not torch.compiler.is_compiling()
        if cacheable:
            key = (seq, device, self.inv_freq.data_ptr(), tensor_version(self.inv_freq))
            if self._cached is not None and self._cached[0] == key:
                return self._cached[1], self._cached[2]
        positions = torch.arange(seq, device=device).unsqueeze(0) if position_ids is None else position_ids
        with torch.no_grad():  # positions carry no gradient; keeps the cached tables out of any graph
            cos, sin = self.cos_sin(positions)
            half = self.rotary_dim // 2
            signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        if cacheable:
            self._cached = (key, cos, signed_sin)
        return cos, signed_sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x `[b, n, s, d]` with rotary applied to `x[..., :rotary_dim]`, from `tables(...)`."""
        whole = self.rotary_dim == x.shape[-1]
        rot = x if whole else x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
        rot = (rot.float() * cos + swapped.float() * signed_sin).to(x.dtype)
        return rot if whole else torch.cat([rot, x[..., self.rotary_dim :]], dim=-1)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x `[b, n, s, d]` -> the same with rotary applied to `x[..., :rotary_dim]`."""
        cos, signed_sin = self.tables(position_ids, x.shape[-2], x.device)
        return self.rotate(x, cos, signed_sin)


# --- alibi -----------------------------------------------------------------------------------
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head slopes of the ALiBi paper: a geometric series, interleaved for non-powers of 2."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(power_of_two_slopes(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


def alibi_bias(slopes: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """`[n, s_q, s_k]` additive bias -slope * (i - j) from `distance` `[s_q, s_k]` = query pos i - key pos j
    (0 where the key is in the future; those are masked anyway)."""
    return -slopes.view(-1, 1, 1) * distance.clamp(min=0)


# --- relative position bias (T5) -------------------------------------------------------------
def relative_position_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal buckets for `distance` = query pos - key pos (>= 0 for visible keys).

    The first half of the buckets holds distances 0, 1, ... exactly; the rest grow
    logarithmically up to `max_distance`, beyond which everything shares the last bucket.
    """
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, far)


class RelativePositionBias(nn.Module):
    """A learned bias per (distance bucket, head), added to the attention scores.

    One table per layer (GPT-NeoX shares one across layers, which a pipeline split cannot keep in
    sync). The head dim is split across tp ranks like the heads themselves.
    """

    def __init__(self, config: GPTConfig, name: str) -> None:
        super().__init__()
        world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        heads = config.arch.heads
        self.num_buckets, self.max_distance = config.rpe_num_buckets, config.rpe_max_distance
        self.weight = nn.Parameter(torch.empty(self.num_buckets, heads // world, dtype=config.params_dtype))
        initialize_param_(
            self.weight, f"{name}.weight", config.seed, config.init_fn(), (self.num_buckets, heads), 1, rank, world
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1)

    def forward(self, distance: torch.Tensor) -> torch.Tensor:
        """`[n/tp, s_q, s_k]` bias for `distance` `[s_q, s_k]` = query pos - key pos."""
        buckets = relative_position_bucket(distance, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1)  # [n/tp, s_q, s_k]
