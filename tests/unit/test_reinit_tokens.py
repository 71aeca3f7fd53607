"""``reinit_tokens`` against Levanter's rule computed directly in the test.

The rule (stanford-crfm/levanter at 9263f81e, src/levanter/main/sft.py:353-360, ``_reinit_embed_vectors``): each
named token's row becomes ``truncated_normal(-3, 3) * std + mean``, ``mean``/``std`` per hidden unit over the
matrix's vocabulary rows (``hax.mean``/``hax.std`` over "vocab": population std), the re-drawn rows included; the
embedding (``reinit_embeddings``) and the LM head (``reinit_lm_head``) each with a draw of their own (sft.py:336-346);
``reinit_tokens: true`` names five llama3 tokens (sft.py:250-258); a token the tokenizer lacks is an error
(sft.py:320-329). Levanter's HF start resizes the vocabulary to ``len(tokenizer)`` (sft.py:213), so the statistics
cover the tokenizer's rows: here the padding rows hold 100.0 and would move them if counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFJson
from tokenizers import models

from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.mpu.initialize_weights import param_generator
from megatron.tokenizer.hf import HFBackedTokenizer
from megatron.training.reinit_config import ReinitTokensArgs
from megatron.training.reinit_tokens import reinit_tokens

VOCAB = [f"w{i}" for i in range(36)] + ["<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|eom_id|>"]
PADDED, SEED = 64, 5
CONFIG = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=PADDED, seed=SEED)


def _tokenizer() -> HFBackedTokenizer:
    return HFBackedTokenizer(HFJson(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="w0")), fast=False)


def _model(tied: bool) -> GPTModel:
    model = GPTModel(GPTConfig(**CONFIG, no_weight_tying=not tied))
    with torch.no_grad():
        for layer in (model.embedding.word_embeddings, model.output_layer):
            if layer is not None:
                layer.weight[len(VOCAB):] = 100.0  # padding rows: outside the statistics
    return model


def _levanter_rows(before: torch.Tensor, n: int, stream: str) -> np.ndarray:
    """sft.py:356-358 on the tokenizer's rows, in numpy; the standard draws are Deepy's stream for the matrix."""
    rows = before[: len(VOCAB)].double().numpy()
    mu, std = rows.mean(axis=0), rows.std(axis=0)  # population std, as jnp.std
    z = torch.empty(n, before.shape[1])
    torch.nn.init.trunc_normal_(z, 0.0, 1.0, -3.0, 3.0, generator=param_generator(SEED, f"reinit_tokens.{stream}"))
    assert float(z.abs().max()) <= 3.0
    return z.double().numpy() * std + mu


def _check(after: torch.Tensor, before: torch.Tensor, ids: list[int], expected: np.ndarray | None) -> None:
    others = [i for i in range(PADDED) if expected is None or i not in ids]
    assert torch.equal(after[others], before[others]), "rows not named changed"
    if expected is not None:
        np.testing.assert_allclose(after[ids].double().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("embeddings,head", [(True, True), (False, True), (True, False)])
def test_untied_rows_equal_levanters_formula_and_nothing_else_moves(embeddings: bool, head: bool) -> None:
    model, tokens = _model(tied=False), ["<|eot_id|>", "w3", "<|eom_id|>"]
    ids = [VOCAB.index(t) for t in tokens]
    assert model.output_layer is not None
    emb, out = model.embedding.word_embeddings.weight, model.output_layer.weight
    emb0, out0, rest0 = emb.detach().clone(), out.detach().clone(), {
        k: v.clone() for k, v in model.state_dict().items() if "word_embeddings" not in k and "output_layer" not in k}
    settings = ReinitTokensArgs(reinit_tokens=tokens, reinit_embeddings=embeddings, reinit_lm_head=head)
    done = reinit_tokens(model, settings, _tokenizer(), iteration=0, tied=False, seed=SEED)
    assert done == [name for name, on in (("embedding.word_embeddings.weight", embeddings),
                                          ("output_layer.weight", head)) if on]
    _check(emb.detach(), emb0, ids, _levanter_rows(emb0, 3, "embedding.word_embeddings.weight") if embeddings else None)
    _check(out.detach(), out0, ids, _levanter_rows(out0, 3, "output_layer.weight") if head else None)
    if embeddings and head:  # two draws of their own (sft.py:336: emb_key, lm_key)
        assert not torch.allclose(emb[ids[0]] - emb0[:40].mean(0), out[ids[0]] - out0[:40].mean(0))
    assert all(torch.equal(v, rest0[k]) for k, v in model.state_dict().items() if k in rest0)


@pytest.mark.parametrize("embeddings,head", [(True, True), (False, True)])
def test_tied_weights_are_one_matrix_redrawn_once(embeddings: bool, head: bool) -> None:
    model, tokens = _model(tied=True), ["<|start_header_id|>"]
    assert model.output_layer is None
    emb = model.embedding.word_embeddings.weight
    emb0 = emb.detach().clone()
    done = reinit_tokens(model, ReinitTokensArgs(reinit_tokens=tokens, reinit_embeddings=embeddings,
                                                 reinit_lm_head=head), _tokenizer(), iteration=0, tied=True, seed=SEED)
    assert done == ["embedding.word_embeddings.weight"]
    _check(emb.detach(), emb0, [VOCAB.index(tokens[0])], _levanter_rows(emb0, 1, "embedding.word_embeddings.weight"))


def test_a_token_the_tokenizer_lacks_is_named() -> None:
    model = _model(tied=False)
    with pytest.raises(ConfigError, match="'<|finetune_right_pad_id|>' not in the tokenizer's vocabulary"):
        reinit_tokens(model, ReinitTokensArgs(reinit_tokens=["w1", "<|finetune_right_pad_id|>"]), _tokenizer(),
                      iteration=0, tied=False, seed=SEED)


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
            train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="HFTokenizer")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``_tokenizer()``'s token table as the tokenizer.json an ``HFTokenizer`` config names."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    HFJson(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="w0")).save(str(path))
    return str(path)


@pytest.mark.parametrize("changes,message", [
    ({"reinit_tokens": ["w1", "w2", "w1"]}, r"reinit_tokens=.* names w1 more than once"),
    ({"reinit_tokens": ["w1"], "reinit_lm_head": False, "reinit_embeddings": False}, "re-draws nothing"),
    ({"reinit_tokens": ["w1"], "lora_r": 4}, "reinit_tokens=.*lora_r=4"),
    ({"reinit_tokens": ["w1"], "train_impl": "rm"}, "reinit_tokens=.*train_impl='rm'"),
    ({"reinit_lm_head": False}, "reinit_lm_head=False .*read only with reinit_tokens"),
    ({"reinit_tokens": []}, "reinit_tokens"),
    # what the ranks refused after building the model and the engine (token_ids), now before launch
    ({"reinit_tokens": ["w1"], "tokenizer_type": "CharLevelTokenizer", "vocab_file": None},
     r"reinit_tokens=\['w1'\] \(<mapping>\) looks the tokens up in a Hugging Face tokenizer's token table .* "
     r"tokenizer_type='CharLevelTokenizer' \(<mapping>\) has none"),
    ({"reinit_tokens": ["w1", "<|finetune_right_pad_id|>"]},
     r"reinit_tokens=.* with vocab_file=.*'<\|finetune_right_pad_id\|>' not in the tokenizer's vocabulary"),
])
def test_refusals_name_the_key(changes: dict[str, object], message: str, tokenizer_file: str) -> None:
    from megatron.config_rules import Device
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.derived import finalize

    device = Device(cuda=False, fp16_supported=False)
    base = {**BASE, "vocab_file": tokenizer_file}
    # accepted at ZeRO-3 too (Levanter's default fsdp_axis): tests/distributed/test_zero3_weight_edits.py
    finalize(config_from_mapping({**base, "reinit_tokens": ["<|eot_id|>", "w3"], "zero_optimization": {"stage": 3}}),
             1, device=device)
    with pytest.raises(ConfigError, match=message):
        finalize(config_from_mapping({**base, **changes}), 1, device=device)


def test_at_step_0_only_and_the_optimizers_fp32_copy_follows() -> None:
    """In a bf16 DeepSpeed engine (an fp32 master copy of the weights): a resumed state (step 3) keeps its rows
    (sft.py:232-244 re-draws only when the step is 0); at step 0 the re-drawn rows survive an optimizer step at lr 0,
    so the master copy was refreshed from them (without it the step writes the old rows back)."""
    import deepspeed

    from single_rank import init_single_rank_gloo

    init_single_rank_gloo()
    model = GPTModel(GPTConfig(**CONFIG, no_weight_tying=True, precision="bfloat16"))
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "bf16": {"enabled": True}}
    eng, *_ = deepspeed.initialize(model=model, config=config,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0))
    emb = eng.module.embedding.word_embeddings.weight
    before, ids = emb.detach().clone(), [VOCAB.index("<|eot_id|>")]
    settings = ReinitTokensArgs(reinit_tokens=["<|eot_id|>"])
    assert reinit_tokens(eng.module, settings, _tokenizer(), iteration=3, tied=False, seed=SEED) == []
    assert torch.equal(emb.detach(), before)
    reinit_tokens(eng.module, settings, _tokenizer(), iteration=0, tied=False, seed=SEED, optimizer=eng.optimizer)
    drawn = emb.detach().clone()
    assert not torch.equal(drawn[ids], before[ids])
    loss = eng(torch.tensor([[1, 2, 3, 37]])).float().sum()
    eng.backward(loss)
    eng.step()
    assert torch.equal(emb.detach(), drawn)
