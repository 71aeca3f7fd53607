"""Building a model's config in tests from one dict of keys, variants included."""

from __future__ import annotations

from typing import Any

from megatron.model.config import GPTConfig


def gpt_config(**keys: Any) -> GPTConfig:
    """``GPTConfig`` of GPT-NeoX keys; ``value_head`` (not a key: the objective decides it) is applied with
    ``replace``, as the trainer does for ``train_impl: rm``."""
    value_head = bool(keys.pop("value_head", False))
    return GPTConfig(**keys).replace(value_head=value_head)
