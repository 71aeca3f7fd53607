"""GPT-NeoX's checkpoint layout: layer numbers, parameter names and the fused-QKV row order.

Deepy's modules keep their own names (they seed the initialisation, see ``model/gpt.py``) and their
own per-rank ``[q; k; v]`` QKV rows and ``[gate; up]`` gated-MLP rows. Checkpoint files are written
in GPT-NeoX's current layout instead, so GPT-NeoX's tools read them and GPT-NeoX's checkpoints load
here. This module is the whole translation, applied to one tensor-parallel rank's shard at the
file boundary (``files.py`` does the I/O). docs/checkpoint_format.md lists every fact with the
GPT-NeoX file and commit it was read from (EleutherAI/gpt-neox ea7aefd8, 2026-05-19).

* pipeline layer indices (``megatron/model/gpt2_model.py`` ``init_specs``): 0 the embedding, 1 a
  parameter-less step, 2..L+1 the blocks, L+2 a parameter-less step, L+3 the final norm, L+4 the
  output layer (no file when tied to the embedding). Deepy's PipelineModule numbers the same
  modules 0, 1..L, L+1, L+2. The plain model (``pipe_parallel_size: 0``) names every parameter
  ``sequential.<index>.<name>``.
* names (``transformer.py`` ``ParallelMLP``, ``norms.py`` ``RMSNorm``): the final norm ``norm.*``,
  the untied head ``final_linear.weight``, RMSNorm weights ``scale``, the MLP ``mlp.linear1`` and
  ``mlp.linear2`` for every activation (since #1212, Sep 2024); a gated ``linear1`` holds, on each
  tensor-parallel rank, that rank's up rows first and its gate rows second (``Gated_Activation``:
  ``x, gate = x.chunk(2)``, ``act(gate) * x``), Deepy's holds ``[gate; up]``.
* QKV rows per tensor-parallel rank: multi-head attention (``num_kv_heads`` unset or equal to
  ``num_attention_heads``) per head ``[q_h; k_h; v_h]``; grouped-query attention ``[Q; K; V]`` of the
  rank's heads (``gqa_project`` since #1315, Nov 2024; the HF converters since #1345, May 2025).
* with ``gpt_j_residual`` every rank adds its copy of a row-parallel bias before the all-reduce, so
  each file holds ``bias / tp``.

Earlier layouts are read too (never written): GPT-NeoX's mid-2024 names (``mlp.dense_h_to_4h`` /
``dense_4h_to_h``; ``mlp.w1`` gate, ``w3`` up, ``w2`` down for Llama-style MLPs) and its grouped-query
order before Nov 2024 (:data:`PER_QUERY_HEAD`: for each query head of the rank its ``d`` query rows,
then its slice of the rank's key rows and of its value rows). The names tell the first apart; the
QKV order cannot be told from the files and is given by :class:`NeoxNames.gqa_order`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from megatron.errors import CheckpointError
from megatron.model.activations import get_activation

Tensors = dict[str, torch.Tensor]
LayerKind = Literal["embedding", "block", "final_norm", "head"]
GqaOrder = Literal["per_rank", "per_query_head"]
PER_RANK: GqaOrder = "per_rank"
"""GPT-NeoX's grouped-query QKV rows since Nov 2024: ``[Q; K; V]`` of each tensor-parallel rank."""
PER_QUERY_HEAD: GqaOrder = "per_query_head"
"""GPT-NeoX's grouped-query QKV rows before Nov 2024 (and Deepy's checkpoint format 2)."""

_SEQUENTIAL = re.compile(r"^sequential\.(\d+)\.(.+)$")
_ROW_BIASES = ("attention.dense.bias", "mlp.dense_4h_to_h.bias")
_NEOX_ROW_BIASES = ("attention.dense.bias", "mlp.linear2.bias", "mlp.w2.bias", "mlp.dense_4h_to_h.bias")


@dataclass(frozen=True)
class NeoxNames:
    """What the translation needs to know about the model: facts of its shape (worked out from the
    model's config, or from the arguments a checkpoint recorded), not keys of this run's config;
    and, for reading, the grouped-query row order the files hold (written files are always
    :data:`PER_RANK`)."""

    num_layers: int
    heads: int
    kv_heads: int
    gated_mlp: bool
    rmsnorm: bool
    gpt_j_residual: bool = False
    gqa_order: GqaOrder = PER_RANK

    @staticmethod
    def from_config(config: Any) -> NeoxNames:
        """From a ``GPTConfig``."""
        return NeoxNames(
            num_layers=int(config.num_layers),
            heads=int(config.num_attention_heads),
            kv_heads=int(config.kv_heads),
            gated_mlp=get_activation(config.activation).gated,
            rmsnorm=config.norm in ("rmsnorm", "te_rmsnorm"),
            gpt_j_residual=bool(config.gpt_j_residual),
        )

    @staticmethod
    def from_stored(stored: Mapping[str, Any]) -> NeoxNames:
        """From the arguments a checkpoint recorded (``deepy_meta.json``'s ``args``: the run that wrote
        it, which may differ from this run's config), read as GPT-NeoX's names."""
        heads = int(stored["num_attention_heads"])
        return NeoxNames(
            num_layers=int(stored["num_layers"]),
            heads=heads,
            kv_heads=int(stored.get("num_kv_heads") or heads),
            gated_mlp=get_activation(str(stored.get("activation") or "gelu")).gated,
            rmsnorm=str(stored.get("norm") or "layernorm") in ("rmsnorm", "te_rmsnorm"),
            gpt_j_residual=bool(stored.get("gpt_j_residual")),
        )

    @property
    def grouped_query(self) -> bool:
        """Fewer key/value heads than query heads: the files' QKV order depends on GPT-NeoX's version."""
        return self.kv_heads != self.heads

    def reading(self, order: GqaOrder) -> NeoxNames:
        """The same model, read from files whose grouped-query rows are in ``order``."""
        return replace(self, gqa_order=order)

    # --- layer indices -------------------------------------------------------------------------
    def neox_index(self, spec: int) -> int:
        """GPT-NeoX's layer index of Deepy's pipeline spec ``spec``."""
        if spec == 0:
            return 0
        if spec <= self.num_layers:
            return spec + 1
        return spec + 2  # final norm (L+1 -> L+3), head (L+2 -> L+4)

    def spec_index(self, neox: int) -> int | None:
        """Deepy's spec of GPT-NeoX's layer ``neox``; None for its parameter-less steps."""
        if neox == 0:
            return 0
        if neox == 1 or neox == self.num_layers + 2:
            return None
        if neox <= self.num_layers + 1:
            return neox - 1
        return neox - 2

    def kind(self, spec: int) -> LayerKind:
        if spec == 0:
            return "embedding"
        if spec <= self.num_layers:
            return "block"
        return "final_norm" if spec == self.num_layers + 1 else "head"


# --- the fused QKV rows --------------------------------------------------------------------------
def _qkv_sizes(rows: int, heads: int, kv_heads: int) -> tuple[int, int] | None:
    """(d, key rows per query head) of one rank's QKV with ``rows`` rows; None if it does not fit
    (a ZeRO-3 placeholder, an unexpected shape: left as it is)."""
    if rows == 0 or rows % (heads + 2 * kv_heads):
        return None
    d = rows // (heads + 2 * kv_heads)
    if (kv_heads * d) % heads:
        raise CheckpointError(
            f"GPT-NeoX's QKV layout needs head_dim * num_kv_heads divisible by num_attention_heads "
            f"(here {d} * {kv_heads} over {heads} per tensor-parallel rank)"
        )
    return d, kv_heads * d // heads


def qkv_to_neox(t: torch.Tensor, heads: int, kv_heads: int, order: GqaOrder = PER_RANK) -> torch.Tensor:
    """One rank's ``[q; k; v]`` rows (``heads``/``kv_heads`` on this rank) -> GPT-NeoX's order: per head
    ``[q_h; k_h; v_h]`` for multi-head attention; for grouped-query attention unchanged
    (:data:`PER_RANK`) or grouped by query head (:data:`PER_QUERY_HEAD`)."""
    if kv_heads != heads and order == PER_RANK:
        return t
    sizes = _qkv_sizes(t.shape[0], heads, kv_heads)
    if sizes is None:
        return t
    d, per = sizes
    rest = t.shape[1:]
    q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d])
    grouped = torch.cat([q.reshape(heads, d, *rest), k.reshape(heads, per, *rest), v.reshape(heads, per, *rest)], 1)
    return grouped.reshape(t.shape).contiguous()


def qkv_from_neox(t: torch.Tensor, heads: int, kv_heads: int, order: GqaOrder = PER_RANK) -> torch.Tensor:
    """The inverse of :func:`qkv_to_neox`."""
    if kv_heads != heads and order == PER_RANK:
        return t
    sizes = _qkv_sizes(t.shape[0], heads, kv_heads)
    if sizes is None:
        return t
    d, per = sizes
    rest = t.shape[1:]
    q, k, v = t.reshape(heads, d + 2 * per, *rest).split([d, per, per], 1)
    return torch.cat([q.reshape(heads * d, *rest), k.reshape(kv_heads * d, *rest), v.reshape(kv_heads * d, *rest)])


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """``[a; b]`` -> ``[b; a]`` along dim 0: one rank's gated rows between Deepy's ``[gate; up]`` and
    GPT-NeoX's ``[up; gate]`` (its own inverse). Empty tensors (ZeRO-3 placeholders) pass."""
    if t.numel() == 0:
        return t
    first, second = t.chunk(2)
    return torch.cat([second, first]).contiguous()


# --- one layer's tensors -------------------------------------------------------------------------
def _norm_field(field: str, names: NeoxNames) -> str:
    return "scale" if names.rmsnorm and field == "weight" else field


def _our_norm_field(field: str, names: NeoxNames) -> str:
    return "weight" if names.rmsnorm and field == "scale" else field


def layer_to_neox(names: NeoxNames, spec: int, state: Tensors, tp: int) -> Tensors:
    """Deepy's tensors of pipeline layer ``spec`` (names inside the layer, one tp rank's shards)
    -> GPT-NeoX's current names and row order for the same layer. Names it does not know pass unchanged."""
    kind = names.kind(spec)
    out: Tensors = {}
    for name, t in state.items():
        if kind == "final_norm" and name.startswith("final_norm."):
            out["norm." + _norm_field(name.removeprefix("final_norm."), names)] = t
        elif kind == "head" and name == "output_layer.weight":
            out["final_linear.weight"] = t
        elif kind == "block":
            out.update(_block_to_neox(names, name, t, tp))
        else:
            out[name] = t
    return out


_BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm", "norm", "sgu.norm")  # the last two: Mamba, gMLP


def _block_to_neox(names: NeoxNames, name: str, t: torch.Tensor, tp: int) -> Tensors:
    module, _, field = name.rpartition(".")
    if module in _BLOCK_NORMS:
        return {f"{module}.{_norm_field(field, names)}": t}
    if module == "attention.query_key_value":
        return {name: qkv_to_neox(t, names.heads // tp, names.kv_heads // tp, PER_RANK)}
    if name == "attention.rotary.inv_freq":
        return {"attention.rotary_emb.inv_freq": t}
    if names.gpt_j_residual and name in _ROW_BIASES and tp > 1:
        t = t / tp
    if module == "mlp.dense_h_to_4h":
        return {f"mlp.linear1.{field}": swap_halves(t) if names.gated_mlp else t}
    if module == "mlp.dense_4h_to_h":
        return {f"mlp.linear2.{field}": t}
    return {name: t}


def layer_from_neox(names: NeoxNames, spec: int, state: Tensors, tp: int) -> Tensors:
    """The inverse of :func:`layer_to_neox`, for GPT-NeoX's current names and its earlier ones
    (``dense_h_to_4h``/``dense_4h_to_h``, ``w1``/``w3``/``w2``); the grouped-query rows are read in
    ``names.gqa_order``."""
    kind = names.kind(spec)
    out: Tensors = {}
    gated: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        module, _, field = name.rpartition(".")
        if kind == "final_norm" and module == "norm":
            out["final_norm." + _our_norm_field(field, names)] = t
        elif kind == "head" and name == "final_linear.weight":
            out["output_layer.weight"] = t
        elif kind != "block":
            out[name] = t
        elif module in _BLOCK_NORMS:
            out[f"{module}.{_our_norm_field(field, names)}"] = t
        elif module == "attention.query_key_value":
            out[name] = qkv_from_neox(t, names.heads // tp, names.kv_heads // tp, names.gqa_order)
        elif name == "attention.rotary_emb.inv_freq":
            out["attention.rotary.inv_freq"] = t
        elif module in ("mlp.linear1", "mlp.dense_h_to_4h"):
            # GPT-NeoX's fused gated rows are [up; gate] per rank, in both its current and mid-2024 MLP
            out[f"mlp.dense_h_to_4h.{field}"] = swap_halves(t) if names.gated_mlp else t
        elif module in ("mlp.w1", "mlp.w3"):
            gated.setdefault(field, {})[module] = t
        elif module in ("mlp.linear2", "mlp.w2", "mlp.dense_4h_to_h"):
            out[f"mlp.dense_4h_to_h.{field}"] = t
        else:
            out[name] = t
    for field, parts in gated.items():
        if set(parts) != {"mlp.w1", "mlp.w3"}:
            raise CheckpointError(f"a gated MLP needs both mlp.w1.{field} and mlp.w3.{field}; found {sorted(parts)}")
        gate, up = parts["mlp.w1"], parts["mlp.w3"]
        out[f"mlp.dense_h_to_4h.{field}"] = gate if gate.numel() == 0 else torch.cat([gate, up])
    if names.gpt_j_residual and tp > 1 and kind == "block":
        for name in _NEOX_ROW_BIASES:
            if name in state:
                ours = "attention.dense.bias" if name.startswith("attention.") else "mlp.dense_4h_to_h.bias"
                out[ours] = state[name] * tp
    return out


# --- the plain model's state dict ------------------------------------------------------------------
def plain_to_neox(names: NeoxNames, state: Tensors, tp: int) -> Tensors:
    """``GPTModel.state_dict()`` of one tp rank -> GPT-NeoX's ``sequential.<index>.<name>`` dict."""
    # lazy: model.pipeline imports DeepSpeed; reading and converting GPT-NeoX checkpoints offline runs without it
    from megatron.model.pipeline import pipeline_location

    layers: dict[int, Tensors] = {}
    out: Tensors = {}
    for name, t in state.items():
        try:
            spec, local = pipeline_location(name, names.num_layers)
        except ValueError:
            out[name] = t  # not a GPT parameter Deepy knows: kept under its own name
            continue
        layers.setdefault(spec, {})[local] = t
    for spec, layer in sorted(layers.items()):
        index = names.neox_index(spec)
        out.update({f"sequential.{index}.{n}": t for n, t in layer_to_neox(names, spec, layer, tp).items()})
    return out


def is_neox_plain(state: dict[str, Any]) -> bool:
    return any(_SEQUENTIAL.match(name) for name in state)


def plain_from_neox(names: NeoxNames, state: Tensors, tp: int) -> Tensors:
    """The inverse of :func:`plain_to_neox` (GPT-NeoX's parameter-less layers hold nothing)."""
    # lazy: model.pipeline imports DeepSpeed; reading and converting GPT-NeoX checkpoints offline runs without it
    from megatron.model.pipeline import model_parameter_name

    layers: dict[int, Tensors] = {}
    out: Tensors = {}
    for name, t in state.items():
        match = _SEQUENTIAL.match(name)
        if match is None:
            out[name] = t
            continue
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = t
    for index, layer in sorted(layers.items()):
        spec = names.spec_index(index)
        if spec is None:
            raise CheckpointError(f"GPT-NeoX layer {index} holds {sorted(layer)}, but it is a step without parameters "
                                  f"for num_layers={names.num_layers}: the config does not match the checkpoint")
        for local, t in layer_from_neox(names, spec, layer, tp).items():
            out[model_parameter_name(f"{spec}.{local}")] = t
    return out
