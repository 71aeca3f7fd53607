"""Dummy samples for benchmarks and smoke tests (``use_dummy_dataset``): no files at all.

``uniform``: sample ``i`` is drawn from a generator seeded by ``(seed, i)``. ``counter`` (fms-fsdp's
``SteadyCounter``, ``fms_fsdp/utils/dataloader_utils.py`` at 5a296afe): sample ``i`` holds the ids
``i*s ... i*s + s - 1`` modulo the vocabulary, and its targets are those same ids (fms-fsdp yields
``(x, x)``: a model that learns to copy its input learns it). Either way a sample depends only on its
global index: every rank, layout and resume point sees the same tokens for the same sample, and
reading sample 10**9 costs the same as reading sample 0.
"""

from __future__ import annotations

import numpy as np

from typing import Literal

from megatron.errors import DataError

DummyKind = Literal["lm", "pairwise", "reward"]
DummyPattern = Literal["uniform", "counter"]

_SALT = 0xD0_11  # keeps these streams apart from other users of (seed, index) generators


class DummyDataset:
    wraps = True  # any non-negative index is valid

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234,
                 kind: DummyKind = "lm", pattern: DummyPattern = "uniform") -> None:
        if seq_length <= 0 or vocab_size <= 1:
            raise DataError(f"dummy data needs seq_length > 0 and vocab_size > 1, got {seq_length}, {vocab_size}")
        if pattern == "counter" and kind != "lm":
            raise DataError(f"the counter dummy data is language-modelling data, not {kind} data")
        self.num_samples, self.kind, self.pattern = int(num_samples), kind, pattern
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if i < 0:
            raise IndexError(f"negative sample index {i}")
        if self.pattern == "counter":
            ids = (np.arange(self.seq_length, dtype=np.int64) + int(i) * self.seq_length) % self.vocab_size
            # text[:-1] are the inputs and label[1:] the targets: both are ``ids``
            return {"text": np.append(ids, ids[-1]), "label": np.insert(ids, 0, ids[0])}
        rng = np.random.default_rng([int(self.seed), int(i), _SALT])
        draw = lambda: rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)  # noqa: E731
        if self.kind == "pairwise":
            chosen, rejected = draw(), draw()
            return {"chosen": chosen, "rejected": rejected, "chosen_label": chosen.copy(),
                    "rejected_label": rejected.copy()}
        text = draw()
        if self.kind == "reward":
            return {"text": text, "label": text.copy(), "reward": np.array(1.0 if i % 2 else -1.0, dtype=np.float32)}
        return {"text": text}
