"""Preference pairs for DPO and reward-model training: ``chosen`` and ``rejected`` responses.

Pair ``k`` is document ``k`` of the chosen dataset and document ``k`` of the rejected one (each with
its optional label dataset, -100 = no loss). Pairs are never packed: every sample is one pair, each
side truncated/padded to ``seq_length + 1`` tokens (the same length as ``text`` in LM samples, so the
loss shifts them the same way). Padding always gets label -100. With ``allow_chopped: false`` a pair
whose longer side does not fit is dropped instead of truncated. Pair order is shuffled per epoch by
``(seed, epoch)`` like every other dataset.

With ``references`` (DPO's ``reference_logps``: the per-token reference log-probs ``generate.py``'s
precompute writes next to each dataset, format in ``megatron/generation/precompute.py``) each sample
also carries ``chosen_ref``/``rejected_ref``: float32 values aligned with the tokens, cut and padded
(with 0) exactly like them, which the objective sums over the counted labels.
"""

from __future__ import annotations

import numpy as np

from megatron.data.gpt_dataset import IGNORE_INDEX, TokenSource, split_cache_path
from megatron.data.index_cache import dataset_content_key, load_or_build
from megatron.data.sample_index import build_document_index
from megatron.errors import DataError


def _fit(x: np.ndarray, length: int, value: int) -> np.ndarray:
    x = np.asarray(x).astype(np.int64)[:length]
    return np.concatenate([x, np.full(length - len(x), value, dtype=np.int64)])


class PairwiseDataset:
    wraps = True

    def __init__(
        self,
        name: str,
        chosen: TokenSource,
        rejected: TokenSource,
        doc_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        chosen_label: TokenSource | None = None,
        rejected_label: TokenSource | None = None,
        allow_chopped: bool = True,
        prefixes: tuple[str, str] | None = None,
        cache_dir: str | None = None,
        pad_id: int = 0,
        references: tuple[TokenSource, TokenSource] | None = None,
    ) -> None:
        c_sizes, r_sizes = np.asarray(chosen.sizes), np.asarray(rejected.sizes)
        if len(c_sizes) != len(r_sizes):
            raise DataError(f"{name}: {len(c_sizes)} chosen but {len(r_sizes)} rejected documents; "
                            "the pairwise datasets must be written together")
        for side, text, label in (("chosen", chosen, chosen_label), ("rejected", rejected, rejected_label)):
            if label is not None and not np.array_equal(np.asarray(label.sizes), np.asarray(text.sizes)):
                raise DataError(f"{name}: {side} labels are not aligned with {side} tokens")
        lo, hi = doc_range
        if not 0 <= lo < hi <= len(c_sizes):
            raise DataError(f"{name}: pair range [{lo}, {hi}) is empty or outside {len(c_sizes)} pairs")
        self.name, self.lo, self.seq_length, self.pad_id = name, lo, seq_length, pad_id
        self.num_samples = int(num_samples)
        self.sources = {"chosen": (chosen, chosen_label), "rejected": (rejected, rejected_label)}
        self.references = dict(zip(("chosen", "rejected"), references)) if references is not None else {}
        longest = np.maximum(c_sizes[lo:hi], r_sizes[lo:hi]).astype(np.int64)

        def build() -> dict[str, np.ndarray]:
            return build_document_index(longest, seq_length, seed, self.num_samples, "unpacked", allow_chopped)

        if prefixes is None:
            arrays = build()
        else:
            params = {"kind": "pairwise", "rejected": dataset_content_key(prefixes[1]), "docs": [lo, hi],
                      "seq_length": seq_length, "seed": seed, "num_samples": self.num_samples,
                      "allow_chopped": allow_chopped}
            arrays = load_or_build(split_cache_path(prefixes[0], cache_dir, name, params), build)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    def __len__(self) -> int:
        return self.num_samples

    def pair_id(self, i: int) -> int:
        """Absolute document id of the pair behind global sample ``i``."""
        row = int(self.shuffle_idx[int(i) % len(self.shuffle_idx)])
        return int(self.doc_idx[int(self.sample_idx[row, 0])]) + self.lo

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        doc = self.pair_id(i)
        length = self.seq_length + 1
        out: dict[str, np.ndarray] = {}
        for side, (text, label) in self.sources.items():
            tokens = np.asarray(text.get(doc))
            out[side] = _fit(tokens, length, self.pad_id)
            # Without a label dataset every real token is a target; padding never is.
            out[f"{side}_label"] = _fit(np.asarray(label.get(doc)) if label is not None else tokens,
                                        length, IGNORE_INDEX)
            if side in self.references:
                values = np.asarray(self.references[side].get(doc), dtype=np.float32)[:length]
                out[f"{side}_ref"] = np.concatenate([values, np.zeros(length - len(values), dtype=np.float32)])
        return out
