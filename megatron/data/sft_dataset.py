"""Supervised fine-tuning samples: ``text`` plus an aligned per-token ``label`` (-100 = no loss).

The label dataset (``<prefix>_label_document``, written by ``tools/datasets/preprocess_data_with_mask.py``)
has exactly the document lengths of the text dataset, so the same sample index cuts both: when
samples are packed, labels pack the same way, token for token. As in GPT-NeoX, ``label[t]`` is the
target *at* position ``t`` (not shifted); the loss shifts text and label together.
"""

from __future__ import annotations

from megatron.data.gpt_dataset import GPTDataset, TokenSource
from megatron.data.sample_index import PackImpl, Shuffle


class SFTDataset(GPTDataset):
    """A :class:`GPTDataset` whose samples always carry ``label``."""

    def __init__(
        self,
        name: str,
        text: TokenSource,
        label: TokenSource,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        pack_impl: PackImpl = "packed",
        allow_chopped: bool = True,
        prefix: str | None = None,
        cache_dir: str | None = None,
        pad_id: int = 0,
        shuffle: Shuffle = True,
    ) -> None:
        super().__init__(name, text, doc_range, num_samples, seq_length, seed, pack_impl, allow_chopped,
                         aligned={"label": label}, prefix=prefix, cache_dir=cache_dir, pad_id=pad_id, shuffle=shuffle)
