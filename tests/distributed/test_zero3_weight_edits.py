"""Weights written into a model that ZeRO-3 partitions, on 2 gloo ranks (one spawn): the same model as at stage 1.

- ``reinit_tokens`` (Levanter's sft.py re-draw, megatron/training/reinit_tokens.py) on a dp2 ZeRO-3 engine re-draws
  the same rows as on a dp2 ZeRO-1 engine, gives the same first loss, and the rows survive an optimizer step at lr 0
  (DeepSpeed's fp32 master partitions were refreshed from them; without it the step writes the old rows back).
- A GPT-NeoX checkpoint (written by test code from GPT-NeoX's published layout, tests/neox_reference_layout.py)
  loaded into a dp2 ZeRO-3 engine (checkpointing/neox/load.py) holds exactly the checkpoint's tensors, also after a
  step at lr 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed.rank_harness import finish_rank, join_data_parallel_ranks, record_checks, run_ranks

WORLD, SEED = 2, 5
MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, padded_vocab_size=64, seed=SEED,
             no_weight_tying=True)
VOCAB = [f"w{i}" for i in range(36)] + ["<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|eom_id|>"]
REDRAWN = ["<|eot_id|>", "w3"]
MATRICES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model() -> torch.nn.Module:
    from megatron.model import GPTConfig, GPTModel

    return GPTModel(GPTConfig(**MODEL))  # the same initial weights on every rank and stage (seeded by name)


def _engine(stage: int, model: torch.nn.Module):  # type: ignore[no-untyped-def]
    import deepspeed

    from megatron.engine.build import deepspeed_mpu

    config = {"train_batch_size": WORLD, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.0, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      mpu=deepspeed_mpu())
    return engine


def _loss_and_step(engine) -> float:  # type: ignore[no-untyped-def]
    """The loss of this rank's batch, then a step at lr 0 (the weights become the fp32 masters' values)."""
    tokens = torch.tensor([[1, 37, 3, 38, 5, 3, 7, 37, 9]]) + torch.distributed.get_rank()
    logits = engine(tokens[:, :-1]).float()  # [b, s, v]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return float(loss)


def _whole(engine, stage: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage != 3:
        return {k: v.detach().clone() for k, v in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {k: v.detach().clone() for k, v in params.items()}


def check_reinit_tokens() -> None:
    from tokenizers import Tokenizer as HFJson
    from tokenizers import models

    from megatron.tokenizer.hf import HFBackedTokenizer
    from megatron.training.reinit_config import ReinitTokensArgs
    from megatron.training.reinit_tokens import reinit_tokens

    tokenizer = HFBackedTokenizer(HFJson(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="w0")),
                                  fast=False)
    ids = [VOCAB.index(t) for t in REDRAWN]
    initial = dict(_model().named_parameters())
    got: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
    for stage in (1, 3):
        engine = _engine(stage, _model())
        done = reinit_tokens(engine.module, ReinitTokensArgs(reinit_tokens=REDRAWN), tokenizer, iteration=0,
                             tied=False, seed=SEED, optimizer=engine.optimizer, partitioned=stage == 3)
        assert done == list(MATRICES), done
        got[stage] = (_loss_and_step(engine), _whole(engine, stage))
        engine.destroy()
    (loss1, weights1), (loss3, weights3) = got[1], got[3]
    for name in MATRICES:
        before = initial[name].detach()
        assert not torch.equal(weights1[name][ids], before[ids]), f"{name}: no row re-drawn at stage 1"
        others = [i for i in range(before.shape[0]) if i not in ids]
        assert torch.equal(weights3[name][others], before[others]), f"{name}: rows not named moved at stage 3"
    for name, want in weights1.items():
        assert torch.equal(weights3[name], want), f"{name}: stage 3 differs from stage 1 after the step at lr 0"
    assert abs(loss3 - loss1) <= 1e-6, (loss1, loss3)


def check_gpt_neox_checkpoint(out: str) -> None:
    import torch.distributed as dist

    from megatron.checkpointing.neox import load_neox_weights
    from neox_reference_layout import neox_files, write_neox_checkpoint

    generator = torch.Generator().manual_seed(7)
    weights = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=generator)
               for k, v in _model().named_parameters()}  # every rank the same tensors, none the initial ones
    tag = Path(out) / "neox" / "global_step7"
    if dist.get_rank() == 0:
        files = neox_files(weights, num_layers=1, heads=2, kv_heads=2, tp=1, pipeline=False, llama=False)
        write_neox_checkpoint(tag.parent, tag.name, files, pipeline=False, tp=1, iteration=7)
    dist.barrier()
    engine = _engine(3, _model())
    notes = load_neox_weights(engine, tag, dict(MODEL, train_batch_size=WORLD))
    assert "loaded the GPT-NeoX checkpoint" in notes[0], notes
    _loss_and_step(engine)
    loaded = _whole(engine, 3)
    engine.destroy()
    assert sorted(loaded) == sorted(weights)
    for name, want in weights.items():
        assert torch.equal(loaded[name], want), f"{name}: not the checkpoint's tensor after a step at lr 0"


def rank_main(rank: int, out: str) -> None:
    join_data_parallel_ranks(rank, WORLD, "ZERO3_EDITS_TEST_PORT")
    results = record_checks({"reinit_tokens": check_reinit_tokens,
                             "gpt_neox_checkpoint": lambda: check_gpt_neox_checkpoint(out)})
    finish_rank(out, rank, results)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    from tests.e2e.test_parity import free_port

    os.environ["ZERO3_EDITS_TEST_PORT"] = str(free_port())
    return run_ranks(rank_main, WORLD, tmp_path_factory.mktemp("zero3_edits"))


@pytest.mark.parametrize("check", ["reinit_tokens", "gpt_neox_checkpoint"])
def test_at_zero3_as_at_zero1(per_rank: list[dict[str, str]], check: str) -> None:
    for rank, results in enumerate(per_rank):
        assert results[check] == "ok", f"rank {rank}: {results[check]}"
