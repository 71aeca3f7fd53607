"""``char_level_ppl``: an evaluation also reports GPT-NeoX's character-level perplexity, lm_loss_char_lvl_ppl =
exp(lm_loss x tokens / characters) (GPT-NeoX ea7aefd8 megatron/training.py:1590-1644 with ``CharCounter``,
megatron/utils.py:472-500: every row of ``text`` counts ``len(row)`` tokens and ``len(detokenize(row))``
characters), checked on a real one-rank DeepSpeed engine against the loss computed here with plain torch and the
characters counted from the vocabulary's strings."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFJson
from tokenizers import models

from megatron.engine.build import Engine
from megatron.config_rules import RuleContext
from megatron.model import GPTConfig, GPTModel
from megatron.neox_arguments.loading import load_config
from megatron.tokenizer.hf import HFBackedTokenizer
from megatron.training.config import TrainingLoopArgs
from megatron.training.eval_checks import char_level_ppl_needs_text
from megatron.training.evaluate import Evaluator

VOCAB = ["a", "bb", "ccc", "dddd", "e", "ff", "ggggggg", "h"] + [f"w{i}" for i in range(23)] + ["<|endoftext|>"]
"""Words of different lengths, so tokens per character is no round number (the rows draw no end-of-document)."""
MODEL: dict[str, Any] = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=32, seed=5,
             no_weight_tying=True, precision="fp32")  # fmt: skip
ROWS, MICRO, EVAL_ITERS = 2, 2, 3



def _engine() -> Engine:
    import deepspeed

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**MODEL))  # type: ignore[arg-type]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config={"train_batch_size": ROWS * MICRO, "train_micro_batch_size_per_gpu": ROWS,
                                              "steps_per_print": 10**9})
    return Engine(engine=engine, optimizer=engine.optimizer, lr_scheduler=None, config=GPTConfig(**MODEL),  # type: ignore[arg-type]
                  is_pipe=False, ds_config={})


def test_evaluation_reports_the_character_level_perplexity(one_rank: Any) -> None:
    keys = TrainingLoopArgs(char_level_ppl=True, eval_iters=EVAL_ITERS)
    tokenizer = HFBackedTokenizer(HFJson(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="a")),
                                  fast=False)
    gen = torch.Generator().manual_seed(4)
    micro_batches = [{"text": torch.randint(0, len(VOCAB) - 1, (ROWS, MODEL["seq_length"] + 1), generator=gen)}
                     for _ in range(EVAL_ITERS * MICRO)]

    def stream_at(global_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        return iter(micro_batches[global_batch * MICRO:])

    eng = _engine()
    evaluator = Evaluator(eng, stream_at, keys.eval_iters, torch.device("cpu"), micro_count=MICRO,
                          detokenize=tokenizer.detokenize if keys.char_level_ppl else None)
    got = evaluator.evaluate()

    # the reference: mean token loss of plain torch over every evaluated token; a row's characters are its words
    # and the spaces between them (the word-level decoder joins with a space)
    text = torch.cat([b["text"] for b in micro_batches])
    with torch.no_grad():
        logits = eng.engine.module(text[:, :-1])
    loss = float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), text[:, 1:].reshape(-1)))
    tokens = text.numel()
    chars = sum(sum(len(VOCAB[int(i)]) for i in row) + len(row) - 1 for row in text)
    assert got["lm_loss"] == pytest.approx(loss, rel=1e-5)
    assert got["lm_loss_char_lvl_ppl"] == pytest.approx(math.exp(loss * tokens / chars), rel=1e-5)
    assert tokens / chars < 0.5  # longer words than one character: the figure is not the token perplexity

    plain = Evaluator(eng, stream_at, keys.eval_iters, torch.device("cpu"), micro_count=MICRO).evaluate()
    assert "lm_loss_char_lvl_ppl" not in plain and plain["lm_loss"] == pytest.approx(got["lm_loss"])


def test_char_level_ppl_is_refused_for_objectives_without_text(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Only language modelling's batches hold ``text``: DPO's pairs are refused before launch, by name and place."""
    monkeypatch.chdir(tmp_path)
    Path("dpo.yml").write_text("num_layers: 2\ntrain_impl: dpo\nchar_level_ppl: true\n")
    Path("lm.yml").write_text("num_layers: 2\nchar_level_ppl: true\n")
    dpo, lm = load_config(["dpo.yml"]), load_config(["lm.yml"])
    (message,) = char_level_ppl_needs_text(RuleContext(args=dpo.args, provenance=dpo.provenance))
    assert "char_level_ppl=True (dpo.yml:3)" in message and "train_impl" in message, message
    assert char_level_ppl_needs_text(RuleContext(args=lm.args, provenance=lm.provenance)) == []
