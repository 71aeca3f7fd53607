"""RoPE scaling: stretching a rotary model's positions so it can run (and be fine-tuned) longer.

``rope_scaling`` takes Hugging Face's dict (``{"rope_type": "linear", "factor": 4.0}``; the older
``"type"`` spelling is read too) with HF's four kinds, so a scaled model exports and imports with the
same logits:

- ``linear`` (position interpolation): every frequency divided by ``factor``.
- ``dynamic`` (NTK-aware): when a forward sees positions beyond ``max_position_embeddings``, the base
  grows to ``base * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))`` for that length L;
  shorter inputs use the plain frequencies. (transformers keeps a grown table until a call is
  shorter than ``max_position_embeddings`` again; ours depends on the current length only, the
  same for a fresh model or lengths that grow.)
- ``yarn``: frequencies whose wavelength fits many times in ``original_max_position_embeddings``
  stay, the slow ones are interpolated by ``factor``, with a linear ramp between the
  ``beta_fast``/``beta_slow`` rotation counts; cos/sin are multiplied by ``attention_factor``
  (default ``0.1 ln(factor) + 1``), which scales the attention logits.
- ``llama3``: wavelengths above ``original / low_freq_factor`` divided by ``factor``, below
  ``original / high_freq_factor`` kept, smoothly blended between.

The formulas are the published ones (the YaRN paper, Meta's Llama 3.1 release), written here from
their definitions; tests/unit/test_rope_scaling.py compares them with transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from megatron.errors import ConfigError


class RopeScalingError(ConfigError, ValueError):
    """A ``rope_scaling`` dict Deepy cannot honour."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    rope_type: str
    """linear, dynamic, yarn or llama3."""
    factor: float
    """How many times longer than the original context the model should reach."""
    original_max_position_embeddings: int | None = None
    """Context the model was trained at (yarn, llama3)."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original / low_freq_factor are fully interpolated."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotation count above which a frequency is kept."""
    beta_slow: float = 1.0
    """yarn: rotation count below which a frequency is interpolated."""
    attention_factor: float | None = None
    """yarn: cos/sin multiplier; None = 0.1 ln(factor) + 1."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions (transformers' default)."""

    def to_hf(self) -> dict[str, Any]:
        """The fields transformers reads in ``rope_parameters`` (theta and partial factor aside)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": float(self.factor)}
        if self.rope_type in ("yarn", "llama3"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": (),
    "dynamic": (),
    "yarn": ("original_max_position_embeddings",),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
"""The accepted rope_type values and the fields each needs besides ``factor``."""
_HF_ONLY = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
"""Fields of transformers' ``rope_parameters`` that Deepy reads from its own keys instead: a dict copied from
an HF config may carry them, and they are accepted only where they say what those keys say."""


def parse_rope_scaling(value: Mapping[str, Any] | None, max_position_embeddings: int | None = None,
                       own: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """A validated :class:`RopeScaling` from HF's dict (None stays None). ``original_max_position_embeddings``
    defaults to ``max_position_embeddings`` for yarn and llama3, as transformers does. ``own``: the values of
    ``rotary_emb_base`` and ``rotary_pct``; a ``rope_theta`` or ``partial_rotary_factor`` in the dict that
    differs from them is refused (the model reads the keys, so the dict's value would change nothing)."""
    if value is None:
        return None
    raw = dict(value)
    for name, key in _HF_ONLY.items():
        if own is not None and name in raw and own.get(key) is not None and float(raw[name]) != float(own[key]):
            raise RopeScalingError(f"rope_scaling.{name} {raw[name]!r} differs from {key} {own[key]!r}, which is "
                                   f"what the model uses: set {key}: {raw[name]!r} and remove {name} from rope_scaling")
    kind = raw.pop("rope_type", None) or raw.pop("type", None)
    raw.pop("type", None)
    if kind in (None, "default"):
        raise RopeScalingError(f"rope_scaling {dict(value)} names no scaling type; use one of {sorted(_REQUIRED)}, "
                               "or remove rope_scaling")
    if kind not in _REQUIRED:
        raise RopeScalingError(f"rope_scaling type {kind!r} is not supported; use one of {sorted(_REQUIRED)}")
    for name in set(_HF_ONLY) & set(raw):
        raw.pop(name)
    known = {f.name for f in fields(RopeScaling)} - {"rope_type"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RopeScalingError(f"rope_scaling ({kind}) has fields Deepy does not implement: {unknown}; "
                               f"known: {sorted(known)}")
    if raw.get("original_max_position_embeddings") is None and kind in ("yarn", "llama3"):
        raw["original_max_position_embeddings"] = max_position_embeddings
    missing = [name for name in ("factor", *_REQUIRED[kind]) if raw.get(name) is None]
    if missing:
        raise RopeScalingError(f"rope_scaling ({kind}) needs {missing}")
    scaling = RopeScaling(rope_type=str(kind), **raw)
    if not scaling.factor >= 1.0:
        raise RopeScalingError(f"rope_scaling factor {scaling.factor} must be >= 1 (it stretches the context)")
    return scaling


# --- the frequencies of each kind -------------------------------------------------------------------
Frequencies = Callable[[torch.Tensor, float, int, RopeScaling], tuple[torch.Tensor, float]]
"""(plain inv_freq ``[d/2]``, base, rotary dim, scaling) -> (inv_freq, cos/sin multiplier)."""


def _linear(inv_freq: torch.Tensor, base: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    return inv_freq / s.factor, 1.0


def _yarn(inv_freq: torch.Tensor, base: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    assert original is not None  # parse_rope_scaling requires it for yarn (filled from max_position_embeddings)

    def dimension_of(rotations: float) -> float:
        # the dimension i whose wavelength 2 pi base^(2i/d) fits `rotations` times in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0 = keep, 1 = interpolate
    ramp = ramp.to(inv_freq.device)
    scaled = inv_freq / s.factor * ramp + inv_freq * (1 - ramp)
    attention = s.attention_factor if s.attention_factor is not None else 0.1 * math.log(s.factor) + 1.0
    return scaled, float(attention)


def _llama3(inv_freq: torch.Tensor, base: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    assert s.original_max_position_embeddings and s.low_freq_factor and s.high_freq_factor
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / s.low_freq_factor
    short_waves = wavelength < original / s.high_freq_factor
    smooth = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(long_waves, inv_freq / s.factor, blended)
    return torch.where(short_waves, inv_freq, out), 1.0


def dynamic_inv_freq(base: float, dim: int, factor: float, length: int, max_positions: int,
                     device: torch.device) -> torch.Tensor:
    """NTK-aware frequencies for a forward that sees ``length`` positions (plain ones up to ``max_positions``)."""
    length = max(length, max_positions)
    grown = base * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (grown ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


SCALED_FREQUENCIES: dict[str, Frequencies] = {
    "linear": _linear,
    "yarn": _yarn,
    "llama3": _llama3,
}
"""rope_type -> how it changes the frequencies, for the kinds that do not depend on the length
(``dynamic`` does: :func:`dynamic_inv_freq`)."""


def static_frequencies(inv_freq: torch.Tensor, base: float, dim: int,
                       scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, cos/sin multiplier) for every kind whose frequencies do not depend on the length."""
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    return SCALED_FREQUENCIES[scaling.rope_type](inv_freq, base, dim, scaling)
