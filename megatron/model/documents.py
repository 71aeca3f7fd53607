"""Documents inside a packed sample: which document each token belongs to, and attention that
keeps them apart.

A packed sample concatenates documents, each ending with the end-of-document (EOD) token. With
``reset_attention_mask`` a token attends only to the earlier tokens of its own document, and with
``reset_position_ids`` its position counts from the start of its document (Megatron-LM's two keys):
then every document is computed exactly as if it were alone in its sample.

The EOD token belongs to the document it ends: token ``t`` is in document "number of EOD tokens
strictly before ``t``". This is all the model needs (``document_ids`` ``[b, s]``), and it is what any
packing writes (``pack_impl: packed`` for pretraining, ``pack_until_overflow`` for SFT).

Attention over documents (:func:`attend_per_document`) gathers the document pieces of the whole
micro-batch into padded batches, one per length bucket (lengths rounded up to a power of two), and
runs one causal SDPA per bucket: a "varlen" attention whose number of calls does not grow with the
number of documents (at most log2(seq_length) + 1, one for equal-length documents), whose work stays
within 4x of the sum of the squared document lengths (a piece fills more than half its bucket; the
padding sits after the document, where no causal query of it looks), and which never builds a
``[s, s]`` mask. The pieces are read from the device once per micro-batch (a host sync on a GPU) and
the gather plan is reused by every layer. Why not FlexAttention with a document ``mask_mod``: in torch 2.13 its CPU
backward is not implemented (``NotImplementedError: FlexAttention does not support backward on
CPU``), and eager FlexAttention materialises the full score matrix, so on the CPU - where Deepy is
tested - it would be neither trainable nor lean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    """The spans (and the attention's gather plan) of the last ``document_ids`` read, so a forward
    reads them once, not once per layer.

    On a GPU every read is a host sync (the host waits for the device to finish the work queued
    before it), and each layer's attention asks for the same micro-batch's spans. The cached tensor is
    held, so its memory cannot be handed to another tensor while it is the key: a tensor with the same
    memory, offset, shape and strides is a view of the same ids (the detached copies activation
    checkpointing makes included)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.key: tuple[object, ...] = ()
        self.spans: list[list[Span]] = []
        self.plan: DocumentPlan | None = None

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[object, ...]:
        # the version counter (shared by detached views) notices an in-place write to the ids
        return (t.device, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), tensor_version(t))

    def get(self, document_ids: torch.Tensor) -> list[list[Span]] | None:
        if self.ids is None or self.key != self._key(document_ids):
            return None
        return self.spans

    def put(self, document_ids: torch.Tensor, spans: list[list[Span]]) -> None:
        self.ids, self.key, self.spans, self.plan = document_ids, self._key(document_ids), spans, None


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
"""``attend(q, k, v)`` for sequences alone: ``[p, n, l, d]`` (k, v ``[p, n_kv, l, d]``) -> ``[p, n, l, d]``."""


@dataclass(frozen=True)
class DocumentPlan:
    """Where each document piece of a ``[b, s]`` batch goes for attention, as device index tensors.

    ``buckets``: per bucket length ``L``, a ``[p, L]`` index into the ``b * s`` tokens (row-major): row
    ``j`` lists the tokens of one piece, then repeats its last token up to ``L``. ``back``: ``[b * s]``,
    each token's row in the buckets' concatenated ``[sum(p * L)]`` outputs."""

    buckets: tuple[tuple[int, torch.Tensor], ...]
    back: torch.Tensor


def bucket_length(length: int, seq_length: int) -> int:
    """The padded length of a piece: the next power of two, at most the sequence."""
    return min(1 << max(length - 1, 0).bit_length(), seq_length)


def _build_plan(spans: list[list[Span]], s: int, device: torch.device) -> DocumentPlan:
    by_length: dict[int, list[tuple[int, int]]] = {}
    for row, pieces in enumerate(spans):
        for a, e in pieces:
            by_length.setdefault(bucket_length(e - a, s), []).append((row * s + a, e - a))
    back = torch.empty(len(spans) * s, dtype=torch.int64)
    buckets, offset = [], 0
    for length in sorted(by_length):
        starts, counts = torch.tensor(by_length[length], dtype=torch.int64).unbind(-1)  # [p] each
        j = torch.arange(length)
        index = starts[:, None] + torch.minimum(j[None, :], counts[:, None] - 1)  # [p, L]: pad with the last token
        real = j[None, :] < counts[:, None]
        slots = offset + torch.arange(len(starts))[:, None] * length + j[None, :]  # [p, L] rows of the outputs
        back[index[real]] = slots[real]
        offset += len(starts) * length
        buckets.append((length, index.to(device, non_blocking=True)))
    return DocumentPlan(buckets=tuple(buckets), back=back.to(device, non_blocking=True))


def document_plan(document_ids: torch.Tensor) -> DocumentPlan | None:
    """The gather plan of this batch's document pieces (None: one document per row); built once per
    batch from :func:`document_spans` and reused by every layer."""
    spans = document_spans(document_ids)
    if all(len(row) == 1 for row in spans):
        return None
    if _SPANS.plan is None:  # document_spans just cached these ids: the plan belongs to them
        _SPANS.plan = _build_plan(spans, document_ids.shape[-1], document_ids.device)
    return _SPANS.plan


def attend_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """``[b, n, s, d]`` attention where each document of each row sees only itself.

    ``attend`` is the layer's own attention for sequences alone (causal, with its window, ALiBi or
    relative bias), so a document in a packed row is computed as that document alone: the pieces of
    every row are gathered into one padded batch per length bucket and ``attend`` runs once per
    bucket (module docstring)."""
    plan = document_plan(document_ids)
    if plan is None:  # nothing packed: one batched call
        return attend(q, k, v)
    b, n, s, d = q.shape

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, d] -> [b * s, h, d]
        return t.transpose(1, 2).reshape(b * s, t.shape[1], d)

    q_t, k_t, v_t = tokens(q), tokens(k), tokens(v)
    outs = []
    for length, index in plan.buckets:
        def pieces(t: torch.Tensor, index: torch.Tensor = index, length: int = length) -> torch.Tensor:
            return t.index_select(0, index.reshape(-1)).view(index.shape[0], length, t.shape[1], d).transpose(1, 2)

        out = attend(pieces(q_t), pieces(k_t), pieces(v_t))  # [p, n, L, d]
        outs.append(out.transpose(1, 2).reshape(-1, n, d))  # [p * L, n, d]
    out_t = torch.cat(outs).index_select(0, plan.back)  # [b * s, n, d]
    return out_t.view(b, s, n, d).transpose(1, 2)  # [b, n, s, d]
