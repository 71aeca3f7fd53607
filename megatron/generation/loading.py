"""The weights generate.py and eval.py run: the newest committed checkpoint in `load`.

The model is built exactly as training builds it (the same DeepSpeed engine, plain or pipeline),
and the weights come in through the checkpoint code's own loader in weights-only mode
(`megatron.checkpointing.save_load.load_checkpoint`). So a checkpoint saved at another layout is
read the way a resumed training run reads it: through a universal checkpoint (converted once, cached
next to the checkpoint), at any ZeRO stage and between pipeline and plain models
(docs/resume_layouts.md lists what is refused).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron.checkpointing.commit import step_of
from megatron.checkpointing.save_load import LoadOptions, load_checkpoint, resolve_tag
from megatron.errors import CheckpointError

log = logging.getLogger("deepy.checkpoint")

INFERENCE_OVERRIDES: dict[str, Any] = {
    # the KV cache cannot split the sequence; sequence parallelism changes no weight
    "sequence_parallel": False,
    # no backward pass, so nothing to recompute
    "checkpoint_activations": False,
    "selective_checkpointing": None,
    "partition_activations": False,
}
"""Settings the inference model is built with whatever the training config said."""


def load_committed_weights(engine: Any, load: str | None, iteration: int | None, args_dict: dict[str, Any],
                           script: str) -> int:
    """Load the model weights of `load`'s newest committed checkpoint (or of `iteration`) into
    `engine` on every rank; returns the checkpoint's iteration."""
    if not load:
        raise CheckpointError(f"{script} needs `load`: the directory of a trained checkpoint (its weights are used)")
    load_dir = Path(load)
    tag, warnings = resolve_tag(load_dir, iteration)
    for warning in warnings:
        log.warning(warning)
    if tag is None:
        raise CheckpointError(f"{script}: no committed checkpoint in {load_dir}; train first, or point `load` "
                              "at a directory that holds one")
    result = load_checkpoint(engine, load_dir / tag, args_dict, LoadOptions(weights_only=True))
    for note in result.notes:
        log.info("checkpoint: %s", note)
    step = step_of(tag)
    log.info("%s: weights of %s (iteration %s)", script, load_dir / tag, step)
    return int(step or 0)
