"""Documents of a packed sample kept apart (reset_attention_mask, reset_position_ids).

The reference for "a document in a packed sample" is the same model run on that document alone:
each document's summed loss and every parameter gradient of it must match (fp32, 1e-5). The tp2
and pp2 layouts are checked on real gloo ranks in tests/distributed/test_document_mask.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.model import GPTConfig, GPTModel
from megatron.model.documents import document_ids_from_eod, document_spans, positions_in_documents
from megatron.neox_arguments import config_from_mapping
from megatron.config_rules import Device
from megatron.objectives import ObjectiveArgs, build_objective, lm_loss_sum

EOD = 0
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, padded_vocab_size=64, seed=11)
VARIANTS = {
    "learned": dict(),
    "rotary_gqa_swiglu": dict(pos_emb="rotary", num_kv_heads=2, activation="swiglu", intermediate_size=384,
                              norm="rmsnorm"),  # GPT-NeoX's width rule: halves of 128
    "alibi_window": dict(pos_emb="alibi", sliding_window_width=3),
    "rpe_untied": dict(pos_emb="rpe", no_weight_tying=True),
}


def packed_rows(lengths: list[list[int]], seq: int, seed: int = 0) -> torch.Tensor:
    """``[b, seq + 1]`` samples: documents of the given lengths (the last token of each is EOD), cut at
    ``seq + 1`` like the packing does."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        docs = []
        for n in row:
            doc = torch.randint(1, 64, (n,), generator=gen)
            doc[-1] = EOD
            docs.append(doc)
        rows.append(torch.cat(docs)[: seq + 1])
    return torch.stack(rows)


def test_document_ids_and_positions_restart_after_each_eod() -> None:
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0]])
    ids = document_ids_from_eod(tokens, EOD)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]  # the EOD ends (belongs to) its document
    assert positions_in_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert document_spans(ids) == [[(0, 3), (3, 5), (5, 6), (6, 8)], [(0, 8)]]


def test_lm_objective_carries_documents_only_when_asked() -> None:
    sample = {"text": torch.tensor([[5, 6, 0, 7, 8, 0, 9]])}
    both = build_objective(ObjectiveArgs(reset_attention_mask=True, reset_position_ids=True), eod_token=EOD)
    b = both.prepare(sample)
    assert b.document_ids.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert b.pipe_inputs()[2] is b.document_ids and set(b.model_kwargs()) == {"position_ids", "document_ids"}
    only_mask = build_objective(ObjectiveArgs(reset_attention_mask=True), eod_token=EOD).prepare(sample)
    assert only_mask.position_ids is None and only_mask.pipe_inputs()[1].tolist() == [list(range(6))]
    plain = build_objective(ObjectiveArgs(), eod_token=EOD).prepare(sample)
    assert plain.model_kwargs() == {} and plain.pipe_inputs() is plain.inputs


def per_document_check(model: torch.nn.Module, cfg: GPTConfig, text: torch.Tensor, keep_apart: bool) -> float:
    """Largest difference between each document's (loss, gradients) in the packed batch and alone."""
    obj = build_objective(ObjectiveArgs(reset_attention_mask=keep_apart, reset_position_ids=keep_apart),
                          eod_token=EOD)
    batch = obj.prepare({"text": text})
    params = [p for p in model.parameters()]
    worst = 0.0
    for row, spans in enumerate(document_spans(document_ids_from_eod(batch.inputs, EOD))):
        for a, e in spans:
            labels = torch.full_like(batch.labels, -100)
            labels[row, a:e] = batch.labels[row, a:e]  # this document's targets only
            packed_loss, _ = lm_loss_sum(model(batch.inputs, **batch.model_kwargs()), labels)
            packed_grads = torch.autograd.grad(packed_loss, params, allow_unused=True)
            alone_loss, _ = lm_loss_sum(model(batch.inputs[row : row + 1, a:e]), batch.labels[row : row + 1, a:e])
            alone_grads = torch.autograd.grad(alone_loss, params, allow_unused=True)
            worst = max(worst, float((packed_loss - alone_loss).detach().abs()))
            for p, g1, g2 in zip(params, packed_grads, alone_grads):
                g1 = torch.zeros_like(p) if g1 is None else g1
                g2 = torch.zeros_like(p) if g2 is None else g2
                worst = max(worst, float((g1 - g2).abs().max()))
    return worst


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_document_equals_document_alone(variant: str) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**BASE, **VARIANTS[variant]})
    model = GPTModel(cfg)
    text = packed_rows([[5, 9, 7, 6], [11, 14]], cfg.seq_length)
    assert per_document_check(model, cfg, text, keep_apart=True) <= 1e-5
    # the check can fail: without the document mask the later documents see the earlier ones
    assert per_document_check(model, cfg, text, keep_apart=False) > 1e-3


def test_attention_runs_once_per_length_bucket_not_once_per_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 document pieces in 2 rows (15 of 3 or 4 tokens, bucket 4, and one of 5, bucket 8): each
    layer makes two SDPA calls, on [15, heads, 4, d] and [1, heads, 8, d], not one per document (the
    loop of before made 16 per layer: on a GPU a launch each, forward and backward); a row holding one
    document goes into the full-length bucket. (That every document still gets what it gets alone,
    whatever the buckets, is test_packed_document_equals_document_alone's: its pieces fill 3 buckets.)"""
    import torch.nn.functional as F

    from megatron.model import attention

    calls: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    cfg = GPTConfig(**{**BASE, **VARIANTS["alibi_window"], "seq_length": 32})  # a mask broadcast over pieces
    model = GPTModel(cfg)
    text = packed_rows([[4] * 8 + [2], [3, 4, 4, 4, 4, 4, 4, 6]], cfg.seq_length)  # cut to 33: inputs 32
    batch = build_objective(ObjectiveArgs(reset_attention_mask=True), eod_token=EOD).prepare({"text": text})
    model(batch.inputs, **batch.model_kwargs())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert calls == [(15, 4, 4, head_dim), (1, 4, 8, head_dim)] * cfg.num_layers
    calls.clear()
    text = torch.cat([text[:1], packed_rows([[40]], cfg.seq_length)])  # row 1: one document, cut
    batch = build_objective(ObjectiveArgs(reset_attention_mask=True), eod_token=EOD).prepare({"text": text})
    model(batch.inputs, **batch.model_kwargs())
    assert calls == [(8, 4, 4, head_dim), (1, 4, 32, head_dim)] * cfg.num_layers


def test_reset_keys_are_refused_for_pairwise_objectives() -> None:
    from megatron.errors import ConfigError
    from megatron.neox_arguments.derived import finalize

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
                train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")
    ok = finalize(config_from_mapping({**base, "reset_attention_mask": True, "reset_position_ids": True}), 1,
                  device=Device(cuda=False, fp16_supported=False))
    assert ok.args.reset_attention_mask and ok.args.reset_position_ids
    with pytest.raises(ConfigError, match="reset_attention_mask"):
        finalize(config_from_mapping({**base, "train_impl": "dpo", "reset_attention_mask": True}), 1,
                 device=Device(cuda=False, fp16_supported=False))


class _Docs:
    """A corpus in memory (the TokenSource the datasets read)."""

    def __init__(self, docs: list[list[int]]) -> None:
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]
        self.sizes = np.asarray([len(d) for d in docs], dtype=np.int32)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        doc = self.docs[idx]
        return doc[offset:] if length is None else doc[offset : offset + length]


def test_sft_packing_marks_the_documents_it_packed() -> None:
    """pack_until_overflow (SFT) packs whole documents, each ending with EOD (the preprocessing's
    --append-eod): the document ids the objective derives are exactly the dataset's pieces."""
    from megatron.data.sft_dataset import SFTDataset

    gen = np.random.default_rng(3)
    docs = [[*gen.integers(1, 60, int(n) - 1).tolist(), EOD] for n in gen.integers(3, 9, 30)]
    labels = [[-100] * (len(d) // 2) + d[len(d) // 2 :] for d in docs]  # prompt half masked
    ds = SFTDataset("train", _Docs(docs), _Docs(labels), (0, 30), 8, seq_length=16, seed=1,
                    pack_impl="pack_until_overflow")
    obj = build_objective(ObjectiveArgs(reset_attention_mask=True, reset_position_ids=True), eod_token=EOD)
    for i in range(8):
        sample = {k: torch.as_tensor(v).unsqueeze(0) for k, v in ds[i].items()}
        batch = obj.prepare(sample)
        lengths = [length for _, _, length in ds.spans(i)]
        ends = np.cumsum(lengths)  # where each packed document ends in the sample
        got = [e for _, e in document_spans(batch.document_ids)[0]]
        assert got[: len(ends)] == [min(int(e), 16) for e in ends][: len(got)], (i, got, ends)
        assert batch.position_ids[0, : lengths[0]].tolist() == list(range(min(lengths[0], 16)))
