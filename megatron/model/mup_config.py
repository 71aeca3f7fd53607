"""muP (the maximal update parametrisation, Microsoft's ``mup`` package): the ``use_mup`` keys GPT-NeoX's
``NeoXArgsTraining`` group declares.

Declared beside the model that reads them (``megatron/model/mup.py``: base shapes, the muP initialisation and the
output multiplier; ``embedding.py`` and ``attention.py``: the embedding multipliers and the 1/d attention scale);
the model's :class:`~megatron.model.config.GPTConfig` includes them, as it includes the MoE keys, so every layer
reads them from the one config it is built from. Kept apart from ``mup.py`` so the argument layer reads the keys
without importing torch. What each key does, read from GPT-NeoX ea7aefd8 and mup 1.0.0: docs/mup.md.
"""

from __future__ import annotations

from pydantic import Field

from megatron.config_schema import ArgGroup


class MupArgs(ArgGroup):
    """GPT-NeoX's muP keys (its ``NeoXArgsTraining`` group declares them)."""

    use_mup: bool = False
    """Parametrise the model with muP (GPT-NeoX ea7aefd8, mup 1.0.0): weights of the tensor-parallel layers are
    re-drawn with mup's init (std / sqrt(width multiplier) for weights with two width dimensions) times
    mup_init_scale, attention scores are scaled by 1/head_dim instead of 1/sqrt(head_dim), the output layer's
    input is divided by the width multiplier, the embedding output is multiplied by mup_embedding_mult, and
    Adam/SGD get mup's per-parameter learning rates (MuAdam/MuSGD). Needs base_shapes_file (docs/mup.md)."""

    coord_check: bool = False
    """With use_mup: run muP's coordinate check instead of training (models of widths num_attention_heads x 4 ...
    x 256, muP and standard parametrisation, three steps of the run's Adam or SGD each, mup's get_coord_data), write
    the plots coord_check_up.png and coord_check_sp.png beside base_shapes_file and exit."""

    save_base_shapes: bool = False
    """With use_mup: write the muP base shapes of this model (mup's make_base_shapes of this model and one with
    hidden_size x mup_width_scale) to base_shapes_file and exit without training."""

    base_shapes_file: str | None = None
    """The muP base shapes file (mup's YAML format) that save_base_shapes writes and use_mup reads: one file for
    every rank, full (unsharded) shapes under the model's own parameter names (GPT-NeoX writes one per rank,
    <file>.<rank>, with its module names)."""

    mup_init_scale: float = Field(1.0, gt=0)
    """muP: the re-drawn weights of the tensor-parallel layers (embedding, projections, output layer) are
    multiplied by this."""

    mup_attn_temp: float = Field(1.0, gt=0)
    """muP: attention temperature; the scores are divided by it (on top of muP's 1/head_dim). GPT-NeoX
    ea7aefd8 declares the key but never reads it: a value other than 1 changes Deepy's model only."""

    mup_output_temp: float = Field(1.0, gt=0)
    """muP: output temperature; the logits are divided by it (on top of muP's width multiplier). GPT-NeoX
    ea7aefd8 declares the key but never reads it: a value other than 1 changes Deepy's model only."""

    mup_embedding_mult: float = 1.0
    """muP: the embedding output (after dropout) is multiplied by this; the backward does not see the factor,
    as GPT-NeoX multiplies in place under torch.no_grad."""

    mup_rp_embedding_mult: float = 1.0
    """The learned or sinusoidal position embeddings are multiplied by this before they are added, with or
    without use_mup, as GPT-NeoX ea7aefd8's Embedding does."""

    mup_width_scale: int = Field(2, ge=2)
    """save_base_shapes: hidden_size of the delta model is hidden_size x this (its other sizes stay), which
    tells mup which dimensions are widths."""
