"""What GPT-NeoX's own loader and tools read from a checkpoint besides the weights.

Facts (EleutherAI/gpt-neox ea7aefd8, 2026-05-19):

* ``megatron/checkpointing.py`` ``save_ds_checkpoint`` puts ``iteration`` and ``args`` into the client
  state of ``mp_rank_XX_model_states.pt``; ``args`` holds exactly :data:`NEOX_CHECKPOINT_ARGS`, and its
  ``load_checkpoint`` -> ``check_checkpoint_args`` asserts that each of them equals the loading run's
  value (``getattr(neox_args, name)``: a key GPT-NeoX does not know would stop its load).
* the same function copies the run's config files into ``<tag>/configs/``; its converters read one of
  them (``tools/ckpts/convert_neox_to_hf.py --config_file``), and decide the file layout from it:
  ``pipe_parallel_size`` (absent = 1, so a pipeline), ``model_parallel_size`` (how many files per
  layer), ``num_layers``, ``no_weight_tying`` and the model's shape keys.

So Deepy writes the ``args`` GPT-NeoX writes, and one file in ``configs/`` holding the resolved value of
every key of the run - its config files, its ``key=value`` overrides and the values derived at launch -
so a converter pointed at it reads the layout the run really had. (The files' original text stays in
``deepy_meta.json``'s ``args.config_files``.)
"""

from __future__ import annotations

from typing import Any

import yaml

NEOX_CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
    "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "model_parallel_size",
)  # fmt: skip
RESOLVED_CONFIG = "resolved.yml"
"""The one file Deepy writes into ``<tag>/configs/``."""
_LEFT_OUT = frozenset({"config_files", "iteration"})
"""Not configuration: the files' text (kept in deepy_meta.json) and the step (the checkpoint's own)."""


def neox_checkpoint_args(args: dict[str, Any]) -> dict[str, Any]:
    """The ``args`` entry GPT-NeoX writes into ``mp_rank_XX_model_states.pt``."""
    return {key: args.get(key) for key in NEOX_CHECKPOINT_ARGS}


def resolved_config_text(args: dict[str, Any]) -> str:
    """``configs/resolved.yml``: every key of the run with its resolved value (unset keys left out)."""
    values = {key: value for key, value in sorted(args.items()) if value is not None and key not in _LEFT_OUT}
    header = ("# The resolved configuration of this run (config files, key=value overrides and derived values),\n"
              "# written by Deepy for GPT-NeoX's tools, e.g. tools/ckpts/convert_neox_to_hf.py --config_file.\n")
    return header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False, width=120)


def config_files(args: dict[str, Any]) -> dict[str, str]:
    """``configs/`` file name -> text."""
    return {RESOLVED_CONFIG: resolved_config_text(args)}
