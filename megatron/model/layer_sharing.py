"""Blocks that share one parameter set (``num_unique_layers``, ``param_sharing_style``).

``num_layers`` blocks run, built from ``num_unique_layers`` parameter sets. GPT-NeoX declares the keys
(``megatron/neox_arguments/neox_args.py:280-288``, commit ea7aefd8) and checks that ``num_unique_layers``
divides ``num_layers`` (``arguments.py:1293-1312``) but builds nothing from them: its model always has
``num_layers`` independent blocks. Deepy builds what the help text describes (early Megatron-LM's parameter
sharing, where the names ``grouped``/``spaced`` come from): for num_layers=4, num_unique_layers=2 the parameter
sets run as

* ``grouped``: ``[1, 2, 1, 2]`` (block ``i`` uses set ``i % num_unique_layers``);
* ``spread`` (GPT-NeoX's help text and Megatron-LM call it ``spaced``; both spellings are accepted):
  ``[1, 1, 2, 2]`` (block ``i`` uses set ``i // (num_layers / num_unique_layers)``).

A parameter set is the block of the first position that uses it (its *owner*): the same module object
runs at every position of the set, so its weights are initialised from the owner's canonical names
(``layers.<owner>.*``), its per-layer settings (attention window, inverse-layer scaling) are the owner's,
and autograd sums the gradients of all its positions. Under pipeline parallelism each set is one
DeepSpeed ``TiedLayerSpec`` (``model/pipeline.py``): every stage holding a position of it keeps a copy,
and DeepSpeed all-reduces the copies' gradients over those stages, so the sum is the same.
"""

from __future__ import annotations

SPREAD_STYLES = ("spread", "spaced")
"""The ``param_sharing_style`` values meaning ``[1, 1, 2, 2]``: Deepy's schema's spelling and GPT-NeoX's help
text's (Megatron-LM's value)."""


def sharing_owner(layer_number: int, num_layers: int, num_unique_layers: int | None, style: str) -> int:
    """The first block (0-based) whose parameters block ``layer_number`` runs with; itself without sharing."""
    if num_unique_layers is None or num_unique_layers >= num_layers:
        return layer_number
    if style in SPREAD_STYLES:
        per_set = num_layers // num_unique_layers
        return (layer_number // per_set) * per_set
    return layer_number % num_unique_layers


def sharing_owners(num_layers: int, num_unique_layers: int | None, style: str) -> list[int]:
    """``sharing_owner`` of every block, in order."""
    return [sharing_owner(i, num_layers, num_unique_layers, style) for i in range(num_layers)]


def shared_owners(num_layers: int, num_unique_layers: int | None, style: str) -> frozenset[int]:
    """The owners of the parameter sets that two or more positions share (each a tied module in a pipeline)."""
    owners = sharing_owners(num_layers, num_unique_layers, style)
    return frozenset(owner for i, owner in enumerate(owners) if owner != i)
