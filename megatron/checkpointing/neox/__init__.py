"""GPT-NeoX's checkpoint format, whole: names, file layout, QKV order, reading and writing.

Deepy writes its checkpoints in GPT-NeoX's current layout and reads GPT-NeoX's checkpoints of either era
(docs/checkpoint_format.md lists every fact with the GPT-NeoX file and commit it was read from). One
concept per file, one entry (this package's names):

* ``layout.py``  the translation of one tensor-parallel rank's tensors: layer numbers, parameter names,
                 the fused-QKV and gated-MLP row orders (``NeoxNames``, ``layer_to_neox``, ``plain_to_neox``);
* ``files.py``   the model files: the engine's save/load in that layout (``install``), and every rank's
                 tensors of a checkpoint under ``GPTModel`` names (``canonical_rank_weights``,
                 ``neox_checkpoint_shards``); the QKV order a checkpoint holds (``gqa_order_for``);
* ``record.py``  what GPT-NeoX's tools read besides the weights (the recorded ``args``, ``configs/``), no torch;
* ``load.py``    ``load:`` on a GPT-NeoX checkpoint: its weights into this run's engine;
* ``reader.py``  a GPT-NeoX checkpoint and its config as a ``GPTConfig`` and full weights (the converter);
* ``checks.py``  the before-launch check of ``neox_qkv_order``, no torch.

The names are imported on first use, so the torch-free parts (``checks``, ``record``) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron.checkpointing.neox.files import (  # noqa: F401
        GQA_ORDER_OF_FORMAT,
        ORDER_KEY,
        canonical_rank_weights,
        gqa_order_for,
        install,
        load_model_file,
        neox_checkpoint_shards,
        pipeline_rank_weights,
        plain_rank_weights,
    )
    from megatron.checkpointing.neox.layout import (  # noqa: F401
        PER_QUERY_HEAD,
        PER_RANK,
        GqaOrder,
        NeoxNames,
        layer_from_neox,
        layer_to_neox,
        plain_from_neox,
        plain_to_neox,
        qkv_from_neox,
        qkv_to_neox,
    )
    from megatron.checkpointing.neox.load import load_neox_weights, neox_position, recorded_mismatches  # noqa: F401
    from megatron.checkpointing.neox.reader import NeoxCheckpoint, read_neox_checkpoint, read_neox_config  # noqa: F401
    from megatron.checkpointing.neox.record import config_files, neox_checkpoint_args  # noqa: F401

_EXPORTS = {
    "GqaOrder": "layout", "NeoxNames": "layout", "PER_QUERY_HEAD": "layout", "PER_RANK": "layout",
    "layer_from_neox": "layout", "layer_to_neox": "layout", "plain_from_neox": "layout", "plain_to_neox": "layout",
    "qkv_from_neox": "layout", "qkv_to_neox": "layout",
    "GQA_ORDER_OF_FORMAT": "files", "ORDER_KEY": "files", "canonical_rank_weights": "files",
    "gqa_order_for": "files", "install": "files", "load_model_file": "files", "neox_checkpoint_shards": "files",
    "pipeline_rank_weights": "files", "plain_rank_weights": "files",
    "config_files": "record", "neox_checkpoint_args": "record",
    "load_neox_weights": "load", "neox_position": "load", "recorded_mismatches": "load",
    "NeoxCheckpoint": "reader", "read_neox_checkpoint": "reader", "read_neox_config": "reader",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
