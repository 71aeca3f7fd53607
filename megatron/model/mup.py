"""muP on Deepy's model, as GPT-NeoX ea7aefd8 builds it with Microsoft's ``mup`` package (1.0.0); that package's
arithmetic (base shapes, width multipliers, MuAdam/MuSGD learning rates, its init) is ported in
``megatron/model/mup_shapes.py``, since mup 1.0.0 requires torchvision, which breaks transformers on a CPU torch.

* Base shapes (:func:`apply_base_shapes`; ``megatron/training/mup_actions.py`` writes them): mup's ``make_base_shapes`` of the model and
  of a "delta" model whose ``hidden_size`` is ``mup_width_scale`` times larger tells which dimensions are widths;
  each parameter gets mup's ``infshape`` (GPT-NeoX: ``mup.set_base_shapes(model, file)``). The shapes are the
  full (unsharded) ones under ``GPTModel``'s parameter names, so one file serves every tensor/pipeline layout.
* Initialisation (:func:`apply_base_shapes`): GPT-NeoX re-draws the weight of every tensor-parallel layer
  (``mup_reinitialize_weights``: the token embedding, every Column/RowParallelLinear, the output layer) with
  ``mup.init.normal_(std)`` times ``mup_init_scale``; ``mup.init.normal_`` is ``normal(std)`` for a weight with
  at most one width dimension and ``normal(std / sqrt(width_mult))`` for one with two. Deepy's weights were
  drawn with ``normal(std)`` from their own seeded generator, so multiplying them by that factor gives the same
  distribution (and the same weights in every layout).
* Output: the last hidden state is divided by the output weight's width multiplier before the logits (GPT-NeoX's
  ``_logits_helper`` and ``ColumnParallelLinear`` with ``mup_rescale_parameters``), and by ``mup_output_temp``.
* Optimizer (:func:`mup_param_groups`): mup's MuAdam/MuSGD split of the parameter groups, with the learning rate
  kept as a factor (``lr_scale``) that Deepy's schedule applies at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron.errors import ConfigError
from megatron.model.config import GPTConfig
from megatron.model.mup_shapes import (InfShape, init_factor, load_base_shapes, mu_adam_groups, mu_sgd_groups,
                                       zip_infshape)
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.mpu.topology import get_tensor_model_parallel_world_size

NORMAL_INITS = frozenset({"normal", "scaled_normal", "single_residual_scaled_normal", "wang_init", "small_init"})
"""Init methods that draw ``normal(0, std)`` with a std fixed by the config: mup's ``normal_`` rescales them."""

REDRAWN_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
"""The layers whose weight GPT-NeoX re-draws with the muP init (the ones with ``mup_reinitialize_weights``)."""

NameOf = Callable[[str], str]
"""A module's parameter name -> ``GPTModel``'s name (the identity for a GPTModel; ``model_parameter_name`` for a
pipeline stage)."""


def full_shape(param: torch.Tensor) -> list[int]:
    """The unsharded shape of ``param``: its tensor-parallel dimension times the tensor-parallel size."""
    shape = list(getattr(param, "ds_shape", param.shape))
    if getattr(param, "tensor_model_parallel", False):
        shape[int(getattr(param, "partition_dim"))] *= get_tensor_model_parallel_world_size()
    return shape


def model_shapes(model: nn.Module, name_of: NameOf = lambda name: name) -> dict[str, list[int]]:
    """``GPTModel`` name -> full shape, for every parameter of ``model``."""
    return {name_of(name): full_shape(param) for name, param in model.named_parameters()}


def _infshapes(model: nn.Module, path: str, name_of: NameOf) -> dict[str, InfShape]:
    """mup's ``InfShape`` of each of ``model``'s parameters (by its own name) from the base shapes file (mup's
    ``set_base_shapes(model, file)``: a dimension is a width where the file gives it a base size)."""
    if not Path(path).is_file():
        raise ConfigError(f"base_shapes_file={path!r}: no such file; write it first with save_base_shapes: true")
    shapes = model_shapes(model, name_of)
    base = load_base_shapes(path)
    missing = sorted(set(shapes) - set(base))
    if missing:
        raise ConfigError(f"base_shapes_file={path!r} has no shapes for {missing[:3]} (of {len(missing)}): it was "
                          "written for another model; write it again with save_base_shapes: true")
    return {name: zip_infshape(base[name_of(name)], shapes[name_of(name)]) for name, _ in model.named_parameters()}


@torch.no_grad()
def apply_base_shapes(model: nn.Module, config: GPTConfig, name_of: NameOf = lambda name: name) -> None:
    """``mup.set_base_shapes`` + GPT-NeoX's ``mup_weights_reinit`` on a freshly built ``model`` (a GPTModel or
    this rank's pipeline stage): each parameter gets its ``infshape``; the weight of each tensor-parallel layer is
    rescaled to muP's init times ``mup_init_scale``; the output layer learns its width multiplier."""
    if config.init_method not in NORMAL_INITS or config.output_layer_init_method not in NORMAL_INITS:
        raise ConfigError(f"use_mup: init_method={config.init_method!r} / output_layer_init_method="
                          f"{config.output_layer_init_method!r}: Deepy's muP rescales normal inits only "
                          f"({sorted(NORMAL_INITS)})")
    assert config.base_shapes_file is not None
    infshapes = _infshapes(model, config.base_shapes_file, name_of)
    for name, param in model.named_parameters():
        param.infshape = infshapes[name]  # type: ignore[attr-defined]  # mup's attribute, read by mup_param_groups
    for module in model.modules():
        if isinstance(module, REDRAWN_LAYERS) and not module.weight.is_meta:
            module.weight.mul_(init_factor(infshapes_of(module.weight)) * config.mup_init_scale)
        if hasattr(module, "mup_output_mult"):  # the untied output layer, or the embedding that is the tied one
            head = module if isinstance(module, ColumnParallelLinear) else getattr(module, "word_embeddings")
            setattr(module, "mup_output_mult", 1.0 / (infshapes_of(head.weight).width_mult() * config.mup_output_temp))


def infshapes_of(param: torch.Tensor) -> InfShape:
    """The ``infshape`` that :func:`apply_base_shapes` gave ``param``."""
    infshape = getattr(param, "infshape")
    assert isinstance(infshape, InfShape)
    return infshape


def output_mult(config: GPTConfig) -> float:
    """The output layer's input multiplier before :func:`apply_base_shapes` sets it: 1 without muP, NaN with it
    (a muP model whose base shapes were never applied must not compute anything plausible)."""
    return math.nan if config.use_mup else 1.0


def mup_scaled_input(x: torch.Tensor, mult: float) -> torch.Tensor:
    """The output layer's input times ``mult`` (its ``mup_output_mult``); an error when muP's base shapes were
    never applied to the model (the multiplier is still NaN)."""
    if mult == 1.0:
        return x
    if math.isnan(mult):
        raise ConfigError("use_mup: the model was built without its muP base shapes (megatron/model/mup.py "
                          "apply_base_shapes), so its output multiplier is unknown")
    return x * mult


def straight_through_mult(x: torch.Tensor, mult: float) -> torch.Tensor:
    """``x * mult`` in the forward, ``x``'s gradient unscaled in the backward: GPT-NeoX multiplies the embedding
    output in place under ``torch.no_grad`` (word_embeddings.py), so autograd never sees the factor."""
    if mult == 1.0:
        return x
    return x + (x * (mult - 1.0)).detach()


# --- optimizer ---------------------------------------------------------------------------------------------------
def mup_param_groups(groups: Iterable[dict[str, Any]], kind: str, peak_lr: float) -> list[dict[str, Any]]:
    """mup's MuAdam (``kind`` adam: width-``m`` matrices get ``lr / m`` and ``weight_decay * m``) or MuSGD (sgd)
    split of ``groups`` (Deepy's decay / no-decay groups; ``megatron/model/mup_shapes.py``); each new group's learning
    rate is kept as ``lr_scale`` = its lr over ``peak_lr``, which Deepy's schedule multiplies in at every step."""
    split = mu_sgd_groups if kind == "sgd" else mu_adam_groups
    made = split([dict(g) for g in groups], lr=peak_lr)
    # the groups keep their muP lr too: it is what the optimizer holds until the schedule's first update
    return [{**group, "lr_scale": group.get("lr_scale", 1.0) * (group["lr"] / peak_lr if peak_lr else 1.0)}
            for group in made if group["params"]]  # ZeRO rejects empty groups
