"""Precomputed reference log-probs: the context they were scored with, whether a run may read them, and
their reader (:func:`open_reference_logprobs`; the format is described in ``megatron/generation/precompute.py``,
which writes them).

``generate.py`` precompute (``megatron/generation/precompute.py``) scores a sequence longer than
``seq_length + 1`` tokens in windows of ``seq_length`` inputs, so token ``t > seq_length`` of it is
conditioned on the tokens of its window only. A DPO run reads the first ``seq_length + 1`` tokens of each
sequence, each conditioned on all the tokens before it: the values it reads are the ones it would compute
itself only when every token it reads was scored with its whole past, i.e. when

    min(training seq_length, longest sequence - 1) <= the precompute's seq_length.

Precompute at 32 and train at 128 on pairs of up to 60 tokens broke that silently (step-1 loss 0.709
instead of ln 2). So precompute records its ``seq_length`` beside the dataset, in
``<prefix>_<name>.json`` (``{"seq_length": N}``, written before the ``.idx`` that completes the dataset),
and both ``deepy.py`` (before launch) and the ranks (when they open the files) refuse a run the values do
not fit, by name. Files without the record (an older precompute) are refused too: their context is unknown.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron.atomic_files import atomic_path
from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists, index_file_path, reference_logprobs_prefix
from megatron.errors import DataError

RECORD_SUFFIX = ".json"
LOGPROB_DTYPE = np.float32
"""The values' dtype: MMIDIDX dtype code 7."""


def record_path(reference_prefix: str) -> Path:
    """``<prefix>_<name>.json`` beside the reference dataset ``<prefix>_<name>.bin/.idx``."""
    return Path(reference_prefix + RECORD_SUFFIX)


def write_record(reference_prefix: str, seq_length: int) -> None:
    with atomic_path(record_path(reference_prefix)) as tmp:
        tmp.write_text(json.dumps({"seq_length": int(seq_length)}) + "\n", encoding="utf-8")


def scored_context(reference_prefix: str) -> int | None:
    """The ``seq_length`` the values were scored with (None: no readable record)."""
    try:
        value = json.loads(record_path(reference_prefix).read_text(encoding="utf-8")).get("seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def context_problem(reference_prefix: str, longest_sequence: int, seq_length: int) -> str | None:
    """Why a run at ``seq_length`` must not read these reference values (None when it may): the sentence
    names the precompute's context, the run's and what to do."""
    scored = scored_context(reference_prefix)
    needed = min(int(seq_length), max(int(longest_sequence) - 1, 0))
    if scored is None:
        return (f"{record_path(reference_prefix)} is missing, so the context the values were scored with is "
                f"unknown (an older precompute): recompute them with generate.py text_gen_type=precompute at "
                f"seq_length {seq_length}")
    if needed <= scored:
        return None
    return (f"the values were computed at seq_length {scored} (each token sees at most {scored} tokens before it) "
            f"and this run reads sequences of up to {needed + 1} tokens at seq_length {seq_length}, whose tokens see "
            f"all of them: recompute them with generate.py text_gen_type=precompute at seq_length {seq_length} (or "
            f"train at seq_length {scored})")


# --- the reader ------------------------------------------------------------------------------------
def open_reference_logprobs(data_prefix: str, model_name: str, seq_length: int | None = None) -> MMapIndexedDataset:
    """The reference log-probs of `data_prefix`, checked against its tokens (same sequences, same
    sizes, same documents, float32) and, given the `seq_length` a run reads them at, against the context
    they were scored with. `ds[i]` is a float32 array aligned with the tokens of `i`."""
    prefix = reference_logprobs_prefix(data_prefix, model_name)
    if not dataset_exists(prefix):
        raise DataError(
            f"reference log-probs {prefix}(.bin/.idx) not found: compute them with "
            f"`python deepy.py generate.py CONFIGS... text_gen_type=precompute precompute_model_name={model_name}` "
            "and the reference model's `load`"
        )
    logps = MMapIndexedDataset(prefix)
    tokens = MMapIndexedDataset(data_prefix)
    if np.dtype(logps.dtype) != np.dtype(LOGPROB_DTYPE):
        raise DataError(f"{index_file_path(prefix)} holds {np.dtype(logps.dtype)}, not float32 log-probs")
    if not (np.array_equal(logps.sizes, tokens.sizes) and np.array_equal(logps.doc_idx, tokens.doc_idx)):
        raise DataError(f"{index_file_path(prefix)} is not aligned with {index_file_path(data_prefix)} "
                        "(different sequence sizes or documents): recompute it for this dataset")
    if seq_length is not None:
        problem = context_problem(prefix, int(tokens.sizes.max(initial=0)), seq_length)
        if problem is not None:
            raise DataError(f"reference_logps={model_name!r}: reference log-probs {prefix}: {problem}")
    return logps
