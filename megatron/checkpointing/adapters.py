"""Loading a checkpoint without LoRA adapters (a base model) into a run that trains adapters.

The adapters add state-dict entries (``<layer>.adapter.lora_A/B``) that a base checkpoint does not
have. Such a checkpoint is the run's starting point (``initialize_from`` / ``finetune``): its weights
are loaded strictly into the base layers while the adapters are detached, and the adapters keep
their fresh initialisation (``B == 0``, so the run starts exactly at the base model). Resuming a run
is different: its own checkpoints hold the adapters, so the normal strict load applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from megatron.errors import CheckpointError
from megatron.model.lora import ADAPTER, LoRAAdapter


def _adapter_rank(args: dict[str, Any]) -> int:
    return int(args.get("lora_r") or 0)


@contextlib.contextmanager
def adapters_detached(module: nn.Module) -> Iterator[None]:
    """``module``'s state dict without the adapters inside the block (no forward may run in it)."""
    detached: list[tuple[nn.Module, LoRAAdapter]] = []
    for layer in module.modules():
        adapter = dict(layer.named_children()).get(ADAPTER)
        if isinstance(adapter, LoRAAdapter):
            detached.append((layer, adapter))
    for layer, _ in detached:
        delattr(layer, ADAPTER)  # nn.Module removes a registered child from its children
    try:
        yield
    finally:
        for layer, adapter in detached:
            layer.add_module(ADAPTER, adapter)


def base_for_adapters(saved_args: dict[str, Any], args: dict[str, Any], weights_only: bool) -> bool:
    """A run with adapters starts from a checkpoint without them: the load runs with the adapters detached."""
    return weights_only and _adapter_rank(args) > 0 and _adapter_rank(saved_args) == 0


def base_checkpoint_loading(engine: Any, ckpt_dir: Path, saved_args: dict[str, Any], args: dict[str, Any],
                            weights_only: bool) -> contextlib.AbstractContextManager[None]:
    """The context a load of ``ckpt_dir`` runs in: adapters detached when a run with adapters starts
    from a checkpoint without them; refused when such a checkpoint would be resumed."""
    if _adapter_rank(args) == 0 or _adapter_rank(saved_args) > 0:
        return contextlib.nullcontext()
    if not weights_only:
        raise CheckpointError(
            f"{ckpt_dir} holds no LoRA adapters (it was saved with lora_r 0) and this run trains adapters "
            f"(lora_r {_adapter_rank(args)}): start from it as the frozen base with initialize_from: "
            f"{ckpt_dir.parent} (or finetune: true), and save the adapter run to another directory")
    return adapters_detached(engine.module)
