"""Keys and values of the tokens already seen, for incremental (token-by-token) decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Per-layer keys/values `[b, kv_heads/tp, seen, d]`, stored after rotary so they are never
    re-rotated. Pass the same cache to every `GPTModel.forward` of one generation; each call
    appends its tokens and advances `seen`."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seen: int = 0
    """Tokens in the cache (positions of the next tokens start here)."""
    positions: dict[int, KVCache] = field(default_factory=dict)
    """The caches of blocks that run at several positions (``num_unique_layers``, ``model/layer_sharing.py``):
    one per position, since such a block keys its entries by its own (the owner's) layer number."""

    def at(self, position: int) -> KVCache:
        """The cache of the shared block running at ``position`` (its entries and nothing else's)."""
        return self.positions.setdefault(position, KVCache())

    def past_length(self, layer: int) -> int:
        entry = self.layers.get(layer)
        return 0 if entry is None else entry[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's `[b, n_kv, s, d]` keys/values; returns all of them so far."""
        entry = self.layers.get(layer)
        if entry is not None:
            k, v = torch.cat([entry[0], k], dim=2), torch.cat([entry[1], v], dim=2)
        self.layers[layer] = (k, v)
        return k, v
