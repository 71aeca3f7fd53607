"""KTO samples: one completion per sample with its tokens, labels and a scalar reward.

The reward dataset (``<prefix>_reward_document``) stores one float32 value per document, aligned with
the text/label datasets. Samples are never packed, because a reward belongs to a whole document:
``text``/``label`` are that document truncated/padded to ``seq_length + 1`` (padding label -100) and
``reward`` is a float32 scalar (> 0 desirable, <= 0 undesirable in the KTO loss).
"""

from __future__ import annotations

import numpy as np

from megatron.data.gpt_dataset import GPTDataset, TokenSource
from megatron.errors import DataError


class RewardDataset:
    wraps = True

    def __init__(
        self,
        name: str,
        text: TokenSource,
        label: TokenSource | None,
        reward: TokenSource,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        allow_chopped: bool = True,
        prefix: str | None = None,
        cache_dir: str | None = None,
        pad_id: int = 0,
    ) -> None:
        r_sizes = np.asarray(reward.sizes)
        if len(r_sizes) != len(np.asarray(text.sizes)) or np.any(r_sizes != 1):
            raise DataError(f"{name}: the reward dataset must hold exactly one value per text document "
                            f"({len(r_sizes)} rewards for {len(np.asarray(text.sizes))} documents)")
        aligned = {"label": label} if label is not None else None
        self.inner = GPTDataset(name, text, doc_range, num_samples, seq_length, seed, "unpacked", allow_chopped,
                                aligned=aligned, prefix=prefix, cache_dir=cache_dir, pad_id=pad_id)
        self.reward = reward

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        out = self.inner[i]
        doc = self.inner.spans(int(i))[0][0] + self.inner.lo
        out["reward"] = np.array(self.reward.get(doc)[0], dtype=np.float32)  # 0-d, as collate reads it
        return out
