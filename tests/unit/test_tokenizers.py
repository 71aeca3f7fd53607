"""Tokenizers: the interface, the registry, and the tiktoken fast path giving HF's exact ids."""

from __future__ import annotations

import base64
import inspect
import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from megatron.errors import ConfigError, DataError
from megatron.neox_arguments import config_from_mapping
from megatron.tokenizer import build_tokenizer, padded_vocab_size
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.tokenizer import fast_bpe
from megatron.tokenizer.byte_level import byte_to_char, token_to_bytes
from megatron.tokenizer.hf import GPT2BPETokenizer, HFGPT2Tokenizer, HFTokenizer
from tools.datasets import train_tokenizer

EXTRA = [
    "Unicode: naïve café, 日本語, emoji 🙂, math ∑ ≤ ∞; tabs\tand\r\nwindows lines.",
    "Numbers 12345 678.9 and contractions: it's, we'll, they've, I'd, you're.",
]


def real_texts() -> list[str]:
    """Real prose and code: docstrings of a few standard-library modules, plus some unicode."""
    import argparse
    import collections
    import functools
    import itertools
    import json as json_mod
    import pathlib
    import re
    import textwrap

    texts: list[str] = []
    for mod in (argparse, collections, functools, itertools, json_mod, pathlib, re, textwrap):
        texts.append(inspect.getdoc(mod) or "")
        for name, obj in sorted(vars(mod).items()):
            if not name.startswith("_") and (doc := inspect.getdoc(obj)):
                texts.append(doc)
    texts.append(inspect.getsource(textwrap))
    return [t for t in texts if t.strip()] + EXTRA


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return real_texts()


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer.save(train_tokenizer.train_bpe(texts, vocab_size=600), path)
    return path


def args(**kw: object) -> NeoXArgs:
    """The tokenizer keys through the real loader (unknown keys and types are checked as for a file)."""
    return config_from_mapping({"tokenizer_type": "HFTokenizer", **kw}).args


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(512, 128, 4) == 512
    assert padded_vocab_size(1, 1, 1) == 1


def test_byte_table_is_a_bijection() -> None:
    table = byte_to_char()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert token_to_bytes("Ġhello") == b" hello"
    assert token_to_bytes("<|endoftext|>") == b"<|endoftext|>"
    assert token_to_bytes("€") is None  # not in the byte alphabet


def test_build_sets_padded_vocab_and_ids(tok_json: Path) -> None:
    a = args(vocab_file=str(tok_json))
    tok = build_tokenizer(a)
    assert tok.vocab_size == 600
    assert a.padded(tok.vocab_size, 2) == 768
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    assert tok.eod == hf.token_to_id("<|endoftext|>") == 0
    assert tok.pad == tok.eod  # no <|padding|> in this vocab


def test_fast_path_is_used_and_matches_hf(tok_json: Path, texts: list[str]) -> None:
    tok = HFTokenizer(tok_json)
    assert tok.backend == "tiktoken"
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    expected = [e.ids for e in hf.encode_batch(texts)]
    assert tok.tokenize_batch(texts) == expected
    assert [tok.tokenize(t) for t in texts] == expected
    assert sum(map(len, expected)) > 10_000  # the check covered a real amount of text


def test_special_token_in_text_is_split_out_like_hf(tok_json: Path) -> None:
    tok = HFTokenizer(tok_json)
    text = "end of one<|endoftext|>start of two"
    ids = tok.tokenize(text)
    assert tok.eod in ids
    assert ids == tokenizers.Tokenizer.from_file(str(tok_json)).encode(text).ids


def test_detokenize_round_trips(tok_json: Path, texts: list[str]) -> None:
    tok = HFTokenizer(tok_json)
    for text in texts[:20]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_fast_path_refused_when_merge_order_and_ids_disagree(tok_json: Path) -> None:
    spec = json.loads(tok_json.read_text())
    merges = spec["model"]["merges"]
    merges[10], merges[20] = merges[20], merges[10]  # now ids no longer follow merge priority
    hf = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert fast_bpe.build_fast_encoder(hf) is None


def test_fast_path_refused_when_sample_disagrees(tok_json: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A converter bug (here: a wrong split regex) must be caught by the sample check.
    monkeypatch.setattr(fast_bpe, "GPT2_SPLIT_PATTERN", r"\S+|\s+")
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    assert fast_bpe.build_fast_encoder(hf) is None
    tok = HFTokenizer(tok_json)
    assert tok.backend == "hf"
    assert tok.tokenize("it's a test") == hf.encode("it's a test").ids


def test_prefix_space_tokenizer_falls_back_to_hf(tok_json: Path, texts: list[str]) -> None:
    spec = json.loads(tok_json.read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    path = tok_json.with_name("prefix.json")
    path.write_text(json.dumps(spec))
    tok = HFTokenizer(path)
    assert tok.backend == "hf"
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert tok.tokenize_batch(texts[:10]) == [e.ids for e in hf.encode_batch(texts[:10])]


def test_gpt2_bpe_from_vocab_and_merges(tok_json: Path, tmp_path: Path, texts: list[str]) -> None:
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    vocab, merges = hf.model.save(str(tmp_path))
    tok = build_tokenizer(args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert isinstance(tok, GPT2BPETokenizer) and tok.backend == "tiktoken"
    plain = [t for t in texts if "<|endoftext|>" not in t]
    assert tok.tokenize_batch(plain) == [e.ids for e in hf.encode_batch(plain)]
    # GPT-2's encoder treats the special string in text as plain text.
    assert tok.eod not in tok.tokenize("a<|endoftext|>b")


def test_hf_gpt2_adds_padding_token(tok_json: Path) -> None:
    tok = build_tokenizer(args(tokenizer_type="HFGPT2Tokenizer", vocab_file=str(tok_json)))
    assert isinstance(tok, HFGPT2Tokenizer)
    assert tok.vocab_size == 601 and tok.pad == 600 and tok.eod == 0
    assert tok.backend == "tiktoken"


def test_tiktoken_ranks_file_matches_hf(tok_json: Path, tmp_path: Path, texts: list[str]) -> None:
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    ranks = tmp_path / "tiny.tiktoken"
    lines = []
    for token, tid in sorted(hf.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1]):
        if token != "<|endoftext|>":
            lines.append(f"{base64.b64encode(token_to_bytes(token)).decode()} {tid}")
    ranks.write_text("\n".join(lines) + "\n")
    tok = build_tokenizer(args(tokenizer_type="TiktokenTokenizer", vocab_file=str(ranks)))
    plain = [t for t in texts if "<|endoftext|>" not in t]
    assert tok.tokenize_batch(plain) == [e.ids for e in hf.encode_batch(plain)]
    assert tok.eod == 600
    assert tok.detokenize(tok.tokenize(plain[0])) == plain[0]


def test_sentencepiece(tmp_path: Path, texts: list[str]) -> None:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t.replace("\n", " ") for t in texts))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", user_defined_symbols=["<|endoftext|>"], minloglevel=2)
    tok = build_tokenizer(args(tokenizer_type="SPMTokenizer", vocab_file=str(tmp_path / "sp.model")))
    assert tok.vocab_size == 200
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.eod == sp.piece_to_id("<|endoftext|>")
    assert tok.tokenize_batch(texts[:5]) == [sp.encode(t) for t in texts[:5]]
    assert tok.detokenize(tok.tokenize("hello world")) == "hello world"


def test_char_level() -> None:
    tok = build_tokenizer(args(tokenizer_type="CharLevelTokenizer"))
    assert tok.vocab_size == 512 and tok.eod == 0
    assert tok.tokenize("hé") == [104, 195, 169]
    assert tok.detokenize(tok.tokenize("hé!") + [tok.eod]) == "hé!"
    assert tok.tokenize_batch(["a", "bc"]) == [[97], [98, 99]]


def test_word_level_uses_hf(tmp_path: Path) -> None:
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "wl.json"))
    tok = HFTokenizer(tmp_path / "wl.json")
    assert tok.backend == "hf"
    assert tok.tokenize("hello big world") == [2, 1, 3]


def test_unknown_type_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer_type.*NoSuchTokenizer"):
        build_tokenizer(args(tokenizer_type="NoSuchTokenizer"))
    with pytest.raises(DataError, match="nope.json.*not found"):
        build_tokenizer(args(vocab_file=str(tmp_path / "nope.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json.*not a valid"):
        build_tokenizer(args(vocab_file=str(bad)))
    with pytest.raises(ConfigError, match="merge_file"):
        build_tokenizer(args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(bad)))


def test_many_added_tokens_are_split_out_like_hf(tok_json: Path, tmp_path: Path, texts: list[str]) -> None:
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    hf.add_special_tokens(["<|padding|>", "<|im_start|>", "<|im_end|>", "[MASK]", "<tool>"])
    hf.save(str(tmp_path / "many.json"))
    tok = HFTokenizer(tmp_path / "many.json")
    assert tok.backend == "tiktoken" and tok.pad == hf.token_to_id("<|padding|>")
    mixed = ["<|im_start|>user\nhi there<|im_end|>", "a [MASK] b <tool>x</tool>", "plain text only", *texts[:5]]
    assert tok.tokenize_batch(mixed) == [e.ids for e in hf.encode_batch(mixed)]
    assert hf.token_to_id("<|im_end|>") in tok.tokenize(mixed[0])


def test_verify_fast_path_switches_to_hf_on_disagreement(tok_json: Path, texts: list[str]) -> None:
    tok = HFTokenizer(tok_json)
    assert tok.verify_fast_path(texts) and tok.backend == "tiktoken"
    # Simulate a corpus on which the fast path would be wrong.
    fast = tok._fast
    assert fast is not None
    fast.encode = lambda text: [1, 2, 3]  # type: ignore[method-assign]
    assert not tok.verify_fast_path(texts[:3])
    assert tok.backend == "hf"
    hf = tokenizers.Tokenizer.from_file(str(tok_json))
    assert tok.tokenize(texts[0]) == hf.encode(texts[0]).ids


def test_written_tokenizer_json_has_the_merges_form_every_tokenizers_release_reads(tok_json: Path,
                                                                                   texts: list[str]) -> None:
    """tokenizers 0.15.2 (GPT-NeoX's pin, through transformers 4.38) deserialises BPE merges only as
    ``"a b"`` strings (its models/bpe/serialization.rs: ``Vec<String>``, split at the one space);
    releases >= 0.20 write ``["a", "b"]`` pairs and read both forms. The file Deepy writes holds the
    string form, and the current release reads it back to the same tokenizer."""
    from tokenizers import Tokenizer

    data = json.loads(tok_json.read_text())
    merges = data["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    trained = train_tokenizer.train_bpe(texts, vocab_size=600)
    assert [m.split(" ") for m in merges] == [list(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    back = Tokenizer.from_file(str(tok_json))
    assert all(back.encode(t).ids == trained.encode(t).ids for t in texts[:50])
