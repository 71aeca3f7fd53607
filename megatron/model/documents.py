"""Documents inside a packed sample: which document each token belongs to, and attention that
keeps them apart.

A packed sample concatenates documents, each ending with the end-of-document (EOD) token. With
``reset_attention_mask`` a token attends only to the earlier tokens of its own document, and with
``reset_position_ids`` its position counts from the start of its document (Megatron-LM's two keys):
then every document is computed exactly as if it were alone in its sample.

The EOD token belongs to the document it ends: token ``t`` is in document "number of EOD tokens
strictly before ``t``". This is all the model needs (``document_ids`` ``[b, s]``), and it is what any
packing writes (``pack_impl: packed`` for pretraining, ``pack_until_overflow`` for SFT).

Attention over documents runs one causal SDPA per document piece (:func:`attend_per_document`),
a "varlen" attention by slicing: its cost is the sum of the squared document lengths and it never
builds a ``[s, s]`` mask. Why not FlexAttention with a document ``mask_mod``: in torch 2.13 its CPU
backward is not implemented (``NotImplementedError: FlexAttention does not support backward on
CPU``), and eager FlexAttention materialises the full score matrix, so on the CPU - where Deepy is
tested - it would be neither trainable nor lean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.torch_internals import tensor_version

Span = tuple[int, int]
"""``[start, end)`` of one document piece along the sequence."""


def document_ids_from_eod(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """``[b, s]`` int64: for each token, the number of EOD tokens strictly before it in its row."""
    is_eod = (tokens == eod_token).long()  # [b, s]
    return torch.cumsum(is_eod, dim=-1) - is_eod


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions that restart at 0 where each document starts (``reset_position_ids``)."""
    s = document_ids.shape[-1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)  # [b, s]
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # the start index of each token's document: the last start at or before it
    start_of = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    return index - start_of


class _SpanCache:
    """The spans of the last ``document_ids`` read, so a forward reads them once, not once per layer.

    On a GPU every read is a host sync (the host waits for the device to finish the work queued
    before it), and each layer's attention asks for the same micro-batch's spans. The cached tensor is
    held, so its memory cannot be handed to another tensor while it is the key: a tensor with the same
    memory, offset, shape and strides is a view of the same ids (the detached copies activation
    checkpointing makes included)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.key: tuple[object, ...] = ()
        self.spans: list[list[Span]] = []

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[object, ...]:
        # the version counter (shared by detached views) notices an in-place write to the ids
        return (t.device, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), tensor_version(t))

    def get(self, document_ids: torch.Tensor) -> list[list[Span]] | None:
        if self.ids is None or self.key != self._key(document_ids):
            return None
        return self.spans

    def put(self, document_ids: torch.Tensor, spans: list[list[Span]]) -> None:
        self.ids, self.key, self.spans = document_ids, self._key(document_ids), spans


_SPANS = _SpanCache()


def document_spans(document_ids: torch.Tensor) -> list[list[Span]]:
    """Per row, the ``[start, end)`` ranges of constant document id, in order: one read from the
    device for the whole batch, and none for a batch whose spans were just read."""
    cached = _SPANS.get(document_ids)
    if cached is not None:
        return cached
    b, s = document_ids.shape
    ids = document_ids.detach()
    cuts = torch.nonzero(ids[:, 1:] != ids[:, :-1]) + torch.tensor([0, 1], device=ids.device)  # [k, (row, col)]
    per_row: list[list[int]] = [[] for _ in range(b)]
    for row, col in cuts.tolist():  # the one host read
        per_row[row].append(col)
    out = []
    for row_cuts in per_row:
        bounds = [0, *row_cuts, s]
        out.append(list(zip(bounds[:-1], bounds[1:])))
    _SPANS.put(document_ids, out)
    return out


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q, k, v)`` for one sequence alone: ``[1, n, l, d]`` (k, v ``[1, n_kv, l, d]``) -> ``[1, n, l, d]``."""


def attend_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """``[b, n, s, d]`` attention where each document of each row sees only itself.

    ``attend`` is the layer's own attention for a sequence alone (causal, with its window, ALiBi or
    relative bias), so a document in a packed row is computed as that document alone."""
    spans = document_spans(document_ids)
    if all(len(row) == 1 for row in spans):  # nothing packed: one batched call
        return attend(q, k, v)
    rows = []
    for i, row in enumerate(spans):
        qi, ki, vi = q[i : i + 1], k[i : i + 1], v[i : i + 1]
        parts = [attend(qi[:, :, a:e], ki[:, :, a:e], vi[:, :, a:e]) for a, e in row]  # [1, n, l, d] each
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0)  # [b, n, s, d]
