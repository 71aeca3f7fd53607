"""GPT-NeoX's other layer families (Mamba, RWKV-6, gMLP): which family a layer is, the sizes each derives from
the model's keys (declared in ``GPTConfig``, GPT-NeoX's model keys), and their parameter and FLOP counts.

A layer's family is its ``attention_config`` type: ``mamba``, ``rwkv``, ``gmlp`` / ``amlp`` (gMLP with a
small attention), or an attention type (a transformer block). GPT-NeoX reads the keys below in
``megatron/model/mamba/mamba.py``, ``megatron/model/rwkv/v6/rwkv.py`` and ``megatron/model/gmlp.py``
(commit ea7aefd8, 2026-05-19); the sizes are worked out here the way those modules work them out,
so the model, the parameter count, the FLOPs and the checks read one formula. No torch import: the
launcher checks configs with these.

Facts of GPT-NeoX's code at that commit (each a test in ``tests/unit/test_model_families.py``):

* Mamba (``mamba.py:53-64``): state size 16 and convolution width 4 are fixed; the inner width is
  ``intermediate_size``, else ``expansion_factor`` (default 2) x ``hidden_size``; the rank of the
  step-size projection is ``ceil(hidden_size / 16)``.
* RWKV-6 (``rwkv.py:281-298``): the attention width ``dim_att`` defaults to ``hidden_size`` (its
  doc string; the code leaves it None and fails), heads are ``num_attention_heads`` of
  ``dim_att / num_attention_heads`` channels, and the channel-mix width is ``intermediate_size``, else
  ``expansion_factor`` (default 3.5) x ``hidden_size``, rounded down to a multiple of 32; the code
  overwrites ``head_size`` and ``ffn_dim`` with these values.
* gMLP (``gmlp.py:91-131``): the inner width is 4 x ``hidden_size`` (``ff_mult``, not a key); its
  spatial projection is ``seq_length`` x ``seq_length``; ``amlp`` layers add a one-head attention of
  width ``gmlp_attn_dim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from megatron.model.transformer_options import transformer_mixing_flops, transformer_parameters, transformer_replicated
from megatron.model.option_registry import OptionRegistry

FamilyName = Literal["transformer", "mamba", "rwkv", "gmlp"]
FAMILY_OF_TYPE: dict[str, FamilyName] = {"mamba": "mamba", "rwkv": "rwkv", "gmlp": "gmlp", "amlp": "gmlp"}
"""attention_config type -> layer family; every other type is an attention (transformer) block."""

MAMBA_STATE_SIZE = 16
MAMBA_CONV_WIDTH = 4
GMLP_FF_MULT = 4
RWKV_TIME_MIX_RANK = 32  # GPT-NeoX's TIME_MIX_EXTRA_DIM: rank of the five data-dependent token-shift mixers
RWKV_TIME_DECAY_RANK = 64  # TIME_DECAY_EXTRA_DIM: rank of the data-dependent decay


def family_of(layer_type: str) -> FamilyName:
    return FAMILY_OF_TYPE.get(layer_type, "transformer")


def configured_families(attention_config: list[Any] | None) -> set[FamilyName]:
    """The families of the layer types ``attention_config`` names (whether or not its repeats add up to
    num_layers: another check says so)."""
    if not attention_config:
        return {"transformer"}
    names: set[str] = set()
    for entry in attention_config:
        if isinstance(entry, str):
            names.add(entry)
        elif isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], (list, tuple)):
            names.update(t for t in entry[0] if isinstance(t, str))
    return {family_of(t) for t in names}


def expand_layer_types(config: list[Any], num_layers: int) -> list[str]:
    """GPT-NeoX's ``attention_config`` ``[[types, repeat], ...]`` as one type per layer: each entry contributes
    its ``types`` list ``repeat`` times (``[["global", "local"], 6]`` is 12 layers); ``"all"`` repeats
    the list to fill ``num_layers`` and must divide it. A list of plain strings is already expanded.
    The result must have exactly ``num_layers`` entries (ValueError otherwise)."""
    if all(isinstance(item, str) for item in config):
        types = list(config)
    else:
        types = []
        for kinds, repeats in config:
            if repeats == "all":
                if num_layers % len(kinds) != 0:
                    raise ValueError(f"attention_config entry {[list(kinds), 'all']}: {len(kinds)} types do not "
                                     f"divide num_layers={num_layers}")
                repeats = num_layers // len(kinds)
            types.extend(list(kinds) * int(repeats))
    if len(types) != num_layers:
        raise ValueError(f"attention_config describes {len(types)} layers but num_layers={num_layers}: the repeats "
                         f"(each entry's types times its count) must add up to num_layers")
    return types


# --- sizes (GPT-NeoX's formulas; ``config`` is a GPTConfig or the user's arguments) --------------------
@dataclass(frozen=True)
class MambaShape:
    hidden: int
    inner: int
    state: int = MAMBA_STATE_SIZE
    conv: int = MAMBA_CONV_WIDTH

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.hidden / 16)


def mamba_shape(config: Any) -> MambaShape:
    h = int(config.hidden_size)
    if config.intermediate_size:
        inner = int(config.intermediate_size)
    else:
        inner = int((config.expansion_factor if config.expansion_factor else 2) * h)
    return MambaShape(hidden=h, inner=inner)


@dataclass(frozen=True)
class RWKVShape:
    hidden: int
    dim_att: int
    heads: int
    ffn: int

    @property
    def head_size(self) -> int:
        return self.dim_att // self.heads


def rwkv_derived_shape(config: Any) -> RWKVShape:
    """The sizes as GPT-NeoX's code works them out (it overwrites head_size and ffn_dim with these)."""
    h = int(config.hidden_size)
    if config.intermediate_size:
        ffn = int(config.intermediate_size)
    else:
        ffn = int((config.expansion_factor if config.expansion_factor else 3.5) * h)
    return RWKVShape(hidden=h, dim_att=int(config.dim_att or h), heads=int(config.num_attention_heads),
                     ffn=ffn // 32 * 32)


def rwkv_shape(config: Any) -> RWKVShape:
    """The sizes the layer is built with: ``head_size`` and ``ffn_dim`` where given (the checks accept them only
    when they equal :func:`rwkv_derived_shape`'s), else derived."""
    derived = rwkv_derived_shape(config)
    heads = derived.dim_att // int(config.head_size) if config.head_size else derived.heads
    return RWKVShape(hidden=derived.hidden, dim_att=derived.dim_att, heads=heads,
                     ffn=int(config.ffn_dim) if config.ffn_dim else derived.ffn)


@dataclass(frozen=True)
class GMLPShape:
    hidden: int
    ff: int
    seq: int
    attn_dim: int | None
    """Width of the one-head attention (``amlp`` layers), None for ``gmlp``."""


def gmlp_shape(config: Any, layer_type: str) -> GMLPShape:
    h = int(config.hidden_size)
    return GMLPShape(hidden=h, ff=GMLP_FF_MULT * h, seq=int(config.seq_length),
                     attn_dim=int(config.gmlp_attn_dim) if layer_type == "amlp" else None)


# --- parameters and FLOPs per layer: one registry entry per family (read by flops.py and the memory estimate)
NormParams = Callable[[int], int]
"""Parameters of one of the config's norms over ``dim`` features."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilyEntry:
    """One layer family: the block it builds (plain, and as a pipeline layer) and its counts for one layer of
    ``layer_type``."""

    parameters: Callable[[Any, str, NormParams, int, bool], int]
    """(config, layer type, norm, layer number, active) -> parameters; ``active``: only what one token uses."""
    replicated: Callable[[Any, str, NormParams], int]
    """Parameters every tensor-parallel rank holds whole."""
    mixing_flops: Callable[[Any, str, int], float]
    """Forward FLOPs per token of what mixes positions and is not a weight times the token."""
    non_matmul: Callable[[Any, str], int] = lambda config, layer_type: 0
    """Parameters that do not multiply each token once, left out of the 6 x N (gMLP's spatial projection)."""

    block: Any = None
    """The block's class (``cls(config, layer_number)``); attached by ``blocks.py``, which imports the torch
    modules (this table imports none)."""
    pipe_block: Any = None
    """The same block as a pipeline layer: one input, the hidden state or the tuple passed between stages;
    attached by ``model/pipeline.py``. DeepSpeed's activation checkpointing and stage balancing find the blocks by
    this class's name."""

    def build(self, config: Any, layer_number: int) -> Any:
        return self.block_class()(config, layer_number)

    def block_class(self) -> Any:
        assert self.block is not None, "the block classes are attached by megatron/model/blocks.py"
        return self.block

    def pipe_class(self) -> Any:
        """The pipeline layer's class (a ``LayerSpec`` builds it on its stage)."""
        assert self.pipe_block is not None, "the pipeline layers are attached by megatron/model/pipeline.py"
        return self.pipe_block

    def flops_per_token(self, config: Any, layer_type: str, norm: NormParams, seq_length: int,
                        layer_number: int = 0) -> float:
        """Training FLOPs per token of one layer: 6 per weight a token passes through, 3 x the mixing."""
        matmul = self.parameters(config, layer_type, norm, layer_number, True) - self.non_matmul(config, layer_type)
        return 6.0 * matmul + 3.0 * self.mixing_flops(config, layer_type, seq_length)


def _layernorm(dim: int) -> int:
    return 2 * dim  # torch's LayerNorm with a bias, as GPT-NeoX's RWKV layer builds it whatever `norm` says


def _mamba_parameters(config: Any, layer_type: str, norm: NormParams, layer_number: int, active: bool) -> int:
    h, m = int(config.hidden_size), mamba_shape(config)
    d, r, n = m.inner, m.dt_rank, m.state
    bias = bool(config.mamba_use_bias_in_linears)
    return (norm(h) + h * 2 * d + (2 * d if bias else 0)
            + d * m.conv + (d if config.mamba_use_bias_in_conv else 0)
            + d * (r + 2 * n) + (r + 2 * n if bias else 0)
            + r * d + d + d * n + d
            + d * h + (h if bias else 0))


def _mamba_replicated(config: Any, layer_type: str, norm: NormParams) -> int:
    h, m = int(config.hidden_size), mamba_shape(config)
    return norm(h) + ((m.dt_rank + 2 * m.state) + h if config.mamba_use_bias_in_linears else 0)


def _mamba_mixing(config: Any, layer_type: str, seq_length: int) -> float:
    """The selective scan: 7 per state and channel plus the D skip (GPT-NeoX's ``logging.py`` count
    without the projections)."""
    m = mamba_shape(config)
    return float(m.inner * (7 * m.state + 1))


def _rwkv_parameters(config: Any, layer_type: str, norm: NormParams, layer_number: int, active: bool) -> int:
    h, w = int(config.hidden_size), rwkv_shape(config)
    a, f = w.dim_att, w.ffn
    mixers = 6 * h + h * 5 * RWKV_TIME_MIX_RANK + 5 * RWKV_TIME_MIX_RANK * h
    decay = a + h * RWKV_TIME_DECAY_RANK + RWKV_TIME_DECAY_RANK * a + a
    time_mix = mixers + decay + 4 * h * a + a * h + 2 * a
    channel_mix = 2 * h + h * f + h * h + f * h
    return 2 * _layernorm(h) + time_mix + channel_mix


def _rwkv_replicated(config: Any, layer_type: str, norm: NormParams) -> int:
    return _rwkv_parameters(config, layer_type, norm, 0, False)  # GPT-NeoX has no tensor-parallel RWKV


def _rwkv_mixing(config: Any, layer_type: str, seq_length: int) -> float:
    """The WKV recurrence: 6 x dim_att x head_size (GPT-NeoX's term)."""
    w = rwkv_shape(config)
    return 6.0 * w.dim_att * w.head_size


def _gmlp_parameters(config: Any, layer_type: str, norm: NormParams, layer_number: int, active: bool) -> int:
    h, g = int(config.hidden_size), gmlp_shape(config, layer_type)
    ff = g.ff
    attention = 0 if g.attn_dim is None else 2 * ff * 3 * g.attn_dim + 3 * g.attn_dim + g.attn_dim * ff + ff
    return norm(h) + h * 2 * ff + 2 * ff + norm(ff) + g.seq * g.seq + g.seq + attention + ff * h + h


def _gmlp_replicated(config: Any, layer_type: str, norm: NormParams) -> int:
    h, g = int(config.hidden_size), gmlp_shape(config, layer_type)
    return norm(h) + g.seq * g.seq + g.seq + h + (0 if g.attn_dim is None else 3 * g.attn_dim)


def _gmlp_non_matmul(config: Any, layer_type: str) -> int:
    seq = int(config.seq_length)
    return seq * seq + seq  # the spatial projection mixes positions; its cost is the mixing FLOPs


def _gmlp_mixing(config: Any, layer_type: str, seq_length: int) -> float:
    """The spatial projection (2 x seq x 4h, full sequence as attention is counted) and the small attention."""
    g = gmlp_shape(config, layer_type)
    return 2.0 * seq_length * g.ff + (0.0 if g.attn_dim is None else 4.0 * seq_length * g.attn_dim)


def _families() -> OptionRegistry[FamilyEntry]:
    registry: OptionRegistry[FamilyEntry] = OptionRegistry("layer family")
    for name, entry in {
        "transformer": FamilyEntry(parameters=transformer_parameters, replicated=transformer_replicated,
                                   mixing_flops=transformer_mixing_flops),
        "mamba": FamilyEntry(parameters=_mamba_parameters, replicated=_mamba_replicated, mixing_flops=_mamba_mixing),
        "rwkv": FamilyEntry(parameters=_rwkv_parameters, replicated=_rwkv_replicated, mixing_flops=_rwkv_mixing),
        "gmlp": FamilyEntry(parameters=_gmlp_parameters, replicated=_gmlp_replicated, mixing_flops=_gmlp_mixing,
                            non_matmul=_gmlp_non_matmul),
    }.items():
        registry.register(name, entry, __name__)
    return registry


FAMILIES: OptionRegistry[FamilyEntry] = _families()
"""layer family -> entry (``FAMILY_OF_TYPE`` says which family an ``attention_config`` type is)."""


def family_entry(layer_type: str) -> FamilyEntry:
    return FAMILIES[family_of(layer_type)]


def layer_parameters(config: Any, layer_type: str, norm: NormParams, layer_number: int = 0, active: bool = False) -> int:
    """Parameters of one layer of ``layer_type``: its family's count (GPT-NeoX's module shapes, biases included)."""
    return family_entry(layer_type).parameters(config, layer_type, norm, layer_number, active)


def replicated_layer_parameters(config: Any, layer_type: str, norm: NormParams) -> int:
    """Parameters of one such layer that every tensor-parallel rank holds whole."""
    return family_entry(layer_type).replicated(config, layer_type, norm)


def token_mixing_flops(config: Any, layer_type: str, seq_length: int) -> float:
    """Forward FLOPs per token of what mixes positions (attention's products, the scan, the recurrence, the
    spatial projection)."""
    return family_entry(layer_type).mixing_flops(config, layer_type, seq_length)
