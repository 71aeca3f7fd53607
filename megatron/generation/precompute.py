"""Reference log-probabilities for DPO/KTO, computed once by `generate.py` (`text_gen_type: precompute`).

Format (the contract with the DPO/KTO data readers; read by `data/reference_logprobs.py`'s `open_reference_logprobs`)
---------------------------------------------------------------------------------------------------------------------
For every token dataset `<prefix>.bin/.idx` of the config (`data_path`, `{train,valid,test}_data_paths`,
`pos_`/`neg_{train,valid,test}_data_paths`), the run writes, next to it,

    <prefix>_<precompute_model_name>.bin / .idx

GPT-NeoX's name for the reference dataset of `<prefix>`. It is an MMIDIDX dataset of float32
(dtype code 7) with exactly the token dataset's `sizes` and `doc_idx`: sequence i holds one value
per token of sequence i,

    value[t] = log p(token[t] | token[0..t-1])   (natural log, the loaded model, fp32)
    value[0] = 0.0                               (nothing to condition the first token on)

so it is aligned like a label dataset (`label[t]` is the target *at* position t): a reader cuts
and shifts it exactly as it cuts and shifts the tokens and labels, then masks it with the labels.
Each value is minus the per-token training loss (softmax over the padded vocabulary). Context
restarts at every sequence (document): tokens of a packed sample that follow a document boundary
are scored without the previous document. A sequence longer than `seq_length + 1` is scored in
windows of `seq_length` inputs: token t > 0 sees the tokens from `((t - 1) // seq_length) *
seq_length` up to t - 1, which for t <= seq_length is the whole sequence so far (what a pairwise
sample, truncated to `seq_length + 1` tokens, sees).

Beside it, `<prefix>_<precompute_model_name>.json` records the `seq_length` the values were scored with
(`{"seq_length": N}`); a DPO run reads them only where that context covers every token it reads, and
refuses them otherwise, before launch and on the ranks (`megatron/data/reference_logprobs.py`).

Work is split over data-parallel replicas by contiguous blocks of sequences; each replica writes its
block to a part file and rank 0 joins the parts into the final dataset (written under temporary
names and moved into place, so a crashed run never leaves a dataset that looks complete).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch.distributed as dist

from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    dataset_exists,
    index_file_path,
    reference_logprobs_prefix,
)
from megatron.data.reference_logprobs import LOGPROB_DTYPE, write_record
from megatron.errors import DataError
from megatron.generation.replica import ModelReplica
from megatron.generation.scoring import ScoreRequest, score
from megatron.logging.log import get_logger

SEQUENCES_PER_ROUND = 512
"""Sequences scored between two writes: bounds the memory a replica holds at once."""


# --- computing -----------------------------------------------------------------------------------
def sequence_requests(tokens: list[int], max_length: int) -> list[ScoreRequest]:
    """Windows of `max_length` inputs that score tokens 1.. of one sequence, each exactly once."""
    return [(tokens[start : start + max_length + 1], 1) for start in range(0, len(tokens) - 1, max_length)]


def sequence_logprobs(replica: ModelReplica, sequences: list[list[int]], *, batch_size: int, max_length: int,
                      eod: int) -> list[np.ndarray]:
    """Per-token reference values (the format above) of each sequence; every rank of the replica gets them."""
    requests: list[ScoreRequest] = []
    owners: list[int] = []
    for i, tokens in enumerate(sequences):
        windows = sequence_requests(tokens, max_length)
        requests.extend(windows)
        owners.extend([i] * len(windows))
    scored = score(replica, requests, batch_size=batch_size, max_length=max_length, eod=eod)
    pieces: list[list[float]] = [[0.0] if tokens else [] for tokens in sequences]
    for owner, result in zip(owners, scored):  # windows of one sequence come in order
        pieces[owner].extend(result.logprobs)
    return [np.asarray(p, dtype=LOGPROB_DTYPE) for p in pieces]


def _block(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def _rounds(lo: int, hi: int) -> Iterator[range]:
    for start in range(lo, hi, SEQUENCES_PER_ROUND):
        yield range(start, min(hi, start + SEQUENCES_PER_ROUND))


def _part_prefix(out_prefix: str, dp_rank: int) -> str:
    return f"{out_prefix}.part{dp_rank:05d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def precompute_dataset(replica: ModelReplica, data_prefix: str, model_name: str, *, batch_size: int,
                       max_length: int, eod: int) -> str:
    """Write the reference log-probs of one token dataset; call on every rank. Returns the prefix written."""
    tokens = MMapIndexedDataset(data_prefix)
    out = reference_logprobs_prefix(data_prefix, model_name)
    lo, hi = _block(len(tokens), replica.dp_rank, replica.dp_size)
    write_part(replica, tokens, out, lo, hi, batch_size=batch_size, max_length=max_length, eod=eod)
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        join_parts(tokens, out, replica.dp_size, seq_length=max_length)
    _barrier()
    return out


def write_part(replica: ModelReplica, tokens: MMapIndexedDataset, out: str, lo: int, hi: int, *, batch_size: int,
               max_length: int, eod: int) -> None:
    """Sequences [lo, hi) into this replica's part file (written by its first rank)."""
    part = _part_prefix(out, replica.dp_rank)
    builder = MMapIndexedDatasetBuilder(data_file_path(part), LOGPROB_DTYPE) if replica.speaks_for_replica else None
    for chunk in _rounds(lo, hi):
        values = sequence_logprobs(replica, [tokens[i].astype(np.int64).tolist() for i in chunk],
                                   batch_size=batch_size, max_length=max_length, eod=eod)
        if builder is not None:
            for v in values:
                builder.add_item(v)
                builder.end_document()
    if builder is not None:
        builder.finalize(index_file_path(part))


def join_parts(tokens: MMapIndexedDataset, out: str, parts: int, *, seq_length: int) -> None:
    """Concatenate the replicas' blocks, with the token dataset's document boundaries; ``seq_length``: the
    context they were scored with, recorded beside them before the index completes the dataset."""
    doc_ends = set(int(x) for x in tokens.doc_idx[1:])
    builder = MMapIndexedDatasetBuilder(data_file_path(out), LOGPROB_DTYPE)
    written = 0
    for r in range(parts):
        part = MMapIndexedDataset(_part_prefix(out, r))
        for i in range(len(part)):
            builder.add_item(part[i])
            written += 1
            if written in doc_ends:
                builder.end_document()
    if written != len(tokens):
        builder.abort()
        raise DataError(f"precompute wrote {written} sequences for {index_file_path(tokens.prefix)}, "
                        f"which has {len(tokens)}")
    write_record(out, seq_length)
    builder.finalize(index_file_path(out))
    for r in range(parts):
        for path in (data_file_path(_part_prefix(out, r)), index_file_path(_part_prefix(out, r))):
            Path(path).unlink(missing_ok=True)
    get_logger().info("precompute: wrote %s.bin/.idx (%d sequences, %d values)", out, len(tokens),
                      int(tokens.sizes.sum(dtype=np.int64)))


def precompute_all(replica: ModelReplica, data_prefixes: list[str], model_name: str, *, batch_size: int,
                   max_length: int, eod: int) -> list[str]:
    """Reference log-probs for every dataset of the config (each prefix once)."""
    written: list[str] = []
    for prefix in dict.fromkeys(data_prefixes):
        if not dataset_exists(prefix):
            raise DataError(f"dataset {prefix}(.bin/.idx) not found; fix the data paths in the config")
        written.append(precompute_dataset(replica, prefix, model_name, batch_size=batch_size,
                                          max_length=max_length, eod=eod))
    if not written:
        raise DataError("precompute found no token datasets: set data_path or {train,valid,test}_data_paths "
                        "(or pos_/neg_ paths for preference pairs)")
    return written


__all__ = [
    "precompute_all",
    "precompute_dataset",
    "reference_logprobs_prefix",
    "sequence_logprobs",
    "sequence_requests",
]
