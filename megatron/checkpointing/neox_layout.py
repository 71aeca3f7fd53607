"""GPT-NeoX's checkpoint layout: layer numbers, parameter names and the fused-QKV row order.

Deepy's modules keep their own names (they seed the initialisation, see ``model/gpt.py``) and their
own ``[q; k; v]`` QKV rows. Checkpoint files are written in GPT-NeoX's layout instead, so GPT-NeoX's
tools read them and GPT-NeoX's checkpoints load here. This module is the whole translation, applied
to one tensor-parallel rank's shard at the file boundary (``neox_files.py`` does the I/O).

Facts of GPT-NeoX's layout (its ``megatron/model/gpt2_model.py`` layer list, ``transformer.py``
QKV split and ``tools/ckpts/*``):

* pipeline layer indices: 0 the embedding, 1 a parameter-less step, 2..L+1 the blocks, L+2 a
  parameter-less step, L+3 the final norm, L+4 the output layer (no file when tied to the
  embedding). Deepy's PipelineModule numbers the same modules 0, 1..L, L+1, L+2.
* the plain model (``pipe_parallel_size: 0``) names every parameter ``sequential.<index>.<name>``.
* names: the final norm is ``norm.*``, the untied head ``final_linear.weight``; RMSNorm weights are
  ``scale``; a gated MLP is ``w1`` (gate), ``w3`` (up), ``w2`` (down) instead of one fused
  ``dense_h_to_4h`` and ``dense_4h_to_h``; the rotary buffer is ``attention.rotary_emb.inv_freq``.
* QKV rows, per tensor-parallel rank, grouped by query head: for each of its query heads, that
  head's ``d`` query rows, then ``d * kv / heads`` key rows and as many value rows (the keys and
  values of all kv heads, in order, cut into one slice per query head). With as many kv heads as
  query heads this is GPT-NeoX's classic per-head ``[q_h; k_h; v_h]``.
* with ``gpt_j_residual`` every rank adds its copy of a row-parallel bias before the all-reduce, so
  each file holds ``bias / tp``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.errors import CheckpointError
from megatron.model.activations import get_activation

Tensors = dict[str, torch.Tensor]
LayerKind = Literal["embedding", "block", "final_norm", "head"]

_SEQUENTIAL = re.compile(r"^sequential\.(\d+)\.(.+)$")
_ROW_BIASES = ("attention.dense.bias", "mlp.dense_4h_to_h.bias")


@dataclass(frozen=True)
class NeoxNames:
    """What the translation needs to know about the model: facts of its shape (worked out from the
    model's config, or from the arguments a checkpoint recorded), not keys of this run's config."""

    num_layers: int
    heads: int
    kv_heads: int
    gated_mlp: bool
    rmsnorm: bool
    gpt_j_residual: bool = False

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


def qkv_to_neox(t: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """One rank's ``[q; k; v]`` rows (``heads``/``kv_heads`` on this rank) -> GPT-NeoX's per-head order."""
    sizes = _qkv_sizes(t.shape[0], heads, kv_heads)
    if sizes is None:
        return t
    d, per = sizes
    rest = t.shape[1:]
    q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d])
    grouped = torch.cat([q.reshape(heads, d, *rest), k.reshape(heads, per, *rest), v.reshape(heads, per, *rest)], 1)
    return grouped.reshape(t.shape).contiguous()


def qkv_from_neox(t: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`qkv_to_neox`."""
    sizes = _qkv_sizes(t.shape[0], heads, kv_heads)
    if sizes is None:
        return t
    d, per = sizes
    rest = t.shape[1:]
    q, k, v = t.reshape(heads, d + 2 * per, *rest).split([d, per, per], 1)
    return torch.cat([q.reshape(heads * d, *rest), k.reshape(kv_heads * d, *rest), v.reshape(kv_heads * d, *rest)])


# --- one layer's tensors -------------------------------------------------------------------------
def _norm_field(field: str, names: NeoxNames) -> str:
    return "scale" if names.rmsnorm and field == "weight" else field


def _our_norm_field(field: str, names: NeoxNames) -> str:
    return "weight" if names.rmsnorm and field == "scale" else field


def layer_to_neox(names: NeoxNames, spec: int, state: Tensors, tp: int) -> Tensors:
    """Deepy's tensors of pipeline layer ``spec`` (names inside the layer, one tp rank's shards)
    -> GPT-NeoX's names and row order for the same layer. Names it does not know pass unchanged."""
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
        return {name: qkv_to_neox(t, names.heads // tp, names.kv_heads // tp)}
    if name == "attention.rotary.inv_freq":
        return {"attention.rotary_emb.inv_freq": t}
    if names.gpt_j_residual and name in _ROW_BIASES and tp > 1:
        t = t / tp
    if names.gated_mlp and module == "mlp.dense_h_to_4h":
        gate, up = t.chunk(2) if t.numel() else (t, t)
        return {f"mlp.w1.{field}": gate.contiguous(), f"mlp.w3.{field}": up.contiguous()}
    if names.gated_mlp and module == "mlp.dense_4h_to_h":
        return {f"mlp.w2.{field}": t}
    return {name: t}


def layer_from_neox(names: NeoxNames, spec: int, state: Tensors, tp: int) -> Tensors:
    """The inverse of :func:`layer_to_neox`."""
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
            out[name] = qkv_from_neox(t, names.heads // tp, names.kv_heads // tp)
        elif name == "attention.rotary_emb.inv_freq":
            out["attention.rotary.inv_freq"] = t
        elif module in ("mlp.w1", "mlp.w3"):
            gated.setdefault(field, {})[module] = t
        elif module == "mlp.w2":
            out[f"mlp.dense_4h_to_h.{field}"] = t
        elif names.gpt_j_residual and name in _ROW_BIASES and tp > 1:
            out[name] = t * tp
        else:
            out[name] = t
    for field, parts in gated.items():
        if set(parts) != {"mlp.w1", "mlp.w3"}:
            raise CheckpointError(f"a gated MLP needs both mlp.w1.{field} and mlp.w3.{field}; found {sorted(parts)}")
        gate, up = parts["mlp.w1"], parts["mlp.w3"]
        out[f"mlp.dense_h_to_4h.{field}"] = gate if gate.numel() == 0 else torch.cat([gate, up])
    if names.gpt_j_residual and tp > 1 and "mlp.w2.bias" in state:
        out["mlp.dense_4h_to_h.bias"] = state["mlp.w2.bias"] * tp
    return out


# --- the plain model's state dict ------------------------------------------------------------------
def plain_to_neox(names: NeoxNames, state: Tensors, tp: int) -> Tensors:
    """``GPTModel.state_dict()`` of one tp rank -> GPT-NeoX's ``sequential.<index>.<name>`` dict."""
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
