"""bitsandbytes (NVIDIA GPU only): ``use_bnb_optimizer``, as GPT-NeoX ea7aefd8 builds it.

* Adam (``optimizer.type`` Adam/AdamW) becomes ``bnb.optim.Adam8bit`` (training.py:1057-1062): its moments are
  kept in 8 bits, block-wise quantised; the update rule is Adam's with decoupled weight decay.
* Learned position embeddings become ``bnb.nn.StableEmbedding`` (word_embeddings.py:71-80, which uses it only
  for the position table: the vocabulary-parallel word embedding stays), a LayerNorm after the lookup whose
  table bitsandbytes keeps 32-bit optimizer state for. Deepy copies its own initialised table into it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.engine.optimizer_config import OptimizerArgs
from megatron.model.positional import LearnedPositionalEmbedding


def adam8bit_arguments(groups: list[dict[str, Any]], cfg: OptimizerArgs) -> dict[str, Any]:
    """``bnb.optim.Adam8bit``'s arguments: the groups (each with its weight decay) and Adam's settings."""
    p = cfg.optimizer_params
    return {"params": groups, "lr": cfg.peak_lr, "betas": tuple(p["betas"]), "eps": p["eps"]}


def build_adam8bit(groups: list[dict[str, Any]], cfg: OptimizerArgs) -> torch.optim.Optimizer:
    # lazy: CUDA-only library (requirements/requirements-kernels.txt); refused before launch where missing
    import bitsandbytes as bnb

    optimizer: torch.optim.Optimizer = bnb.optim.Adam8bit(**adam8bit_arguments(groups, cfg))
    return optimizer


class StablePositionalEmbedding(nn.Module):
    """A learned position table looked up through ``bnb.nn.StableEmbedding`` (lookup, then LayerNorm)."""

    def __init__(self, learned: LearnedPositionalEmbedding) -> None:
        super().__init__()
        # lazy: CUDA-only library (requirements/requirements-kernels.txt)
        import bitsandbytes as bnb

        rows, hidden = learned.weight.shape
        self.offset = learned.offset
        self.table = bnb.nn.StableEmbedding(rows, hidden, device=learned.weight.device, dtype=learned.weight.dtype)
        with torch.no_grad():
            self.table.weight.copy_(learned.weight)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.table(position_ids + self.offset)  # [b, s, h]
        return out


def stable_position_embeddings(model: nn.Module) -> int:
    """Swap each learned position table in ``model`` for a :class:`StablePositionalEmbedding`; how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LearnedPositionalEmbedding):
                setattr(parent, name, StablePositionalEmbedding(child))
                swapped += 1
    return swapped
