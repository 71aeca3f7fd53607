"""Context parallelism (all-to-all over heads) equals one rank, on real gloo ranks.

Each rank first runs the model without any parallel groups on the whole batch (the reference),
then with the sequence split over cp ranks (``MicroBatch.context_piece``): the summed loss over the
pieces and every gradient summed over the context-parallel group (what the data-parallel reduction
does) must equal the reference within 1e-5 (fp32), with and without document masks, for learned
positions with a sliding window, rotary with grouped-query heads and ALiBi. cp2 runs on 2 ranks; cp2·tp2
on 4, where each tensor-parallel rank's gradient shards are gathered first. The all-to-all itself
is checked against direct indexing. The full layout matrix through deepy.py (pipeline, ZeRO,
resume) is tests/e2e/test_long_context.py.
"""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_harness import finish_rank, record_checks, run_ranks

EOD = 0
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=64, seed=9)
CONFIGS: dict[str, dict[str, Any]] = {
    "learned_window": dict(sliding_window_width=5),
    # heads of kv_channels=12, not hidden / heads = 8 (Qwen3, Gemma): the all-to-all moves 12-wide heads
    "rotary_gqa": dict(pos_emb="rotary", num_kv_heads=2, activation="swiglu", intermediate_size=384, kv_channels=12),
    "alibi": dict(pos_emb="alibi"),  # per-head slopes follow the heads through the all-to-all
    # Gemma 2/3: capped scores outside SDPA on the whole sequence of each rank's heads, local/global layers with their
    # own rotary bases, q/k norms, capped logits, scaled embeddings, (1 + w) sandwich norms
    "gemma": dict(pos_emb="rotary", num_kv_heads=2, kv_channels=12, norm="gemma_rmsnorm", norm_placement="sandwich",
                  activation="geglu_tanh", intermediate_size=384, use_qk_layernorm=True, query_pre_attn_scalar=10.0,
                  attn_logit_softcapping=0.5, final_logit_softcapping=1.5, scale_embeddings_by_sqrt_hidden=True,
                  attention_config=[[["local", "global"], 1]], sliding_window_width=5, rope_local_base_freq=100),
}
TP2_CONFIGS = {"learned_window": dict(sliding_window_width=5), "rotary": dict(pos_emb="rotary"),
               # OLMo 2: post-norms; q/k RMSNorm over each whole projection, its squares summed over the tp ranks
               "olmo2": dict(pos_emb="rotary", norm="rmsnorm", norm_placement="post", use_qk_layernorm=True,
                             qk_norm_scope="projection")}


def _text() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    text = torch.randint(1, 64, (2, 17), generator=gen)
    text[0, [3, 9, 10]] = EOD  # documents of 4, 6, 1 and 6 tokens in row 0; row 1 is one document
    return text


def _micro_batch(documents: bool) -> Any:
    from megatron.objectives import ObjectiveArgs, build_objective

    config = ObjectiveArgs(reset_attention_mask=documents, reset_position_ids=documents)
    return build_objective(config, eod_token=EOD).prepare({"text": _text()})


def _reference(cfg, documents: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from megatron.model import GPTModel
    from megatron.objectives import lm_loss_sum

    model = GPTModel(cfg)
    batch = _micro_batch(documents)
    loss, _ = lm_loss_sum(model(batch.inputs, **batch.model_kwargs()), batch.labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_matches(cfg, documents: bool, ref: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    from megatron import mpu
    from megatron.model import GPTModel, tp_partition_of
    from megatron.mpu.initialize_weights import unshard_tensors
    from megatron.objectives import lm_loss_sum

    model = GPTModel(cfg)
    piece = _micro_batch(documents).context_piece(mpu.get_context_parallel_rank(),
                                                  mpu.get_context_parallel_world_size())
    loss, _ = lm_loss_sum(model(piece.inputs, **piece.model_kwargs()), piece.labels)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mpu.get_context_parallel_group())
    torch.testing.assert_close(total, ref[0], atol=1e-5, rtol=1e-6)
    tp = mpu.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mpu.get_context_parallel_group())  # the data-parallel reduction's share
        partition = tp_partition_of(cfg, name) if tp > 1 else None
        if partition is not None:  # this tp rank's shard: gather the full gradient
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad.contiguous(), group=mpu.get_tensor_model_parallel_group())
            grad = unshard_tensors(parts, partition.dim, partition.sections)
        torch.testing.assert_close(grad, ref[1][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def check_all_to_all() -> None:
    from megatron import mpu
    from megatron.mpu.context_parallel import heads_to_sequence, sequence_to_heads

    cp, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    full = torch.randn(2, 4, 8 * cp, 3, generator=torch.Generator().manual_seed(0))  # [b, n, s, d]
    mine = full[:, :, rank * 8 : (rank + 1) * 8]
    heads = sequence_to_heads(mine.transpose(2, 3).transpose(2, 3), cp)  # a non-contiguous view too
    assert torch.equal(heads, full[:, rank * 4 // cp : (rank + 1) * 4 // cp])
    assert torch.equal(heads_to_sequence(heads, cp), mine)


def _rank_main(rank: int, out_dir: str, world: int) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from megatron import mpu
    from megatron.model import GPTConfig

    configs = TP2_CONFIGS if world == 4 else CONFIGS
    cfgs = {name: GPTConfig(**{**BASE, **overrides}) for name, overrides in configs.items()}
    refs = {(name, docs): _reference(cfg, docs) for name, cfg in cfgs.items() for docs in (False, True)}
    tp = world // 2
    mpu.initialize_model_parallel(tp, 1, 2)
    prefix = "cp2_tp2" if tp == 2 else "cp2"
    checks = {f"{prefix}_{name}_{'documents' if docs else 'plain'}": (lambda c=cfgs[name], d=docs, r=ref:
                                                                      check_matches(c, d, r))
              for (name, docs), ref in refs.items()}
    checks[f"{prefix}_all_to_all"] = check_all_to_all
    finish_rank(out_dir, rank, record_checks(checks))


def _cp2(rank: int, out_dir: str) -> None:
    _rank_main(rank, out_dir, 2)


def _cp2_tp2(rank: int, out_dir: str) -> None:
    _rank_main(rank, out_dir, 4)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_cp2, 2, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def cp2_tp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_cp2_tp2, 4, tmp_path_factory.mktemp("cp2_tp2"))


KEYS = [f"cp2_{n}_{d}" for n in CONFIGS for d in ("plain", "documents")] + ["cp2_all_to_all"]
TP2_KEYS = [f"cp2_tp2_{n}_{d}" for n in TP2_CONFIGS for d in ("plain", "documents")] + ["cp2_tp2_all_to_all"]


@pytest.mark.parametrize("key", KEYS)
def test_cp2_equals_one_rank(cp2: list[dict[str, str]], key: str) -> None:
    for rank, per_rank in enumerate(cp2):
        assert per_rank[key] == "ok", f"rank {rank}:\n{per_rank[key]}"


@pytest.mark.parametrize("key", TP2_KEYS)
def test_cp2_tp2_equals_one_rank(cp2_tp2: list[dict[str, str]], key: str) -> None:
    for rank, per_rank in enumerate(cp2_tp2):
        assert per_rank[key] == "ok", f"rank {rank}:\n{per_rank[key]}"
