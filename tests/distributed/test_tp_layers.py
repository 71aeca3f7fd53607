"""Tensor-parallel layers on 2 real gloo ranks equal their unsharded versions, forward and backward.

One spawn runs every check (spawning costs seconds); each rank records per-check results in a
JSON file and each check is reported as its own test.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rank_harness import run_ranks, run_tp_checks

WORLD = 2
SEED = 11


# --- helpers (run inside the ranks) ------------------------------------------------------------
def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    from megatron.mpu import get_tensor_model_parallel_group

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous(), group=get_tensor_model_parallel_group())
    return parts


def _full_weight(name: str, shape: tuple[int, ...], std: float = 0.02) -> torch.Tensor:
    """The full weight as a tp=1 layer would draw it: normal(0, std) from (SEED, name)."""
    from megatron.mpu.initialize_weights import param_generator

    return torch.randn(shape, generator=param_generator(SEED, name), dtype=torch.float32) * std


def _normal(std: float = 0.02):
    from megatron.mpu.initialize_weights import init_method_from_name

    return init_method_from_name("normal", std, 2, 16)


def _same_inputs(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=lambda m: f"{what}: {m}")


# --- the checks --------------------------------------------------------------------------------
def check_column_parallel_linear() -> None:
    from megatron.mpu import ColumnParallelLinear, get_tensor_model_parallel_rank
    from megatron.mpu.initialize_weights import shard_tensor

    rank = get_tensor_model_parallel_rank()
    for gather_output, sections in [(False, None), (True, None), (False, [8, 4, 4])]:
        layer = ColumnParallelLinear(6, 16, name="col", init_fn=_normal(), seed=SEED, bias=True,
                                     gather_output=gather_output, sections=sections)
        with torch.no_grad():
            layer.bias.copy_(shard_tensor(_same_inputs(16, seed=5), 0, rank, WORLD, sections))
        w_full = _full_weight("col.weight", (16, 6)).requires_grad_()
        b_full = _same_inputs(16, seed=5).requires_grad_()
        x = _same_inputs(3, 2, 6, seed=1).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        grad_out = _same_inputs(3, 2, 16, seed=2)

        y_ref = F.linear(x_ref, w_full, b_full)
        y_ref.backward(grad_out)
        y = layer(x)
        if gather_output:
            _close(y, y_ref, "gathered output")
            y.backward(grad_out)
        else:
            _close(y, shard_tensor(y_ref.detach(), 2, rank, WORLD, sections), "output shard")
            y.backward(shard_tensor(grad_out, 2, rank, WORLD, sections))
        _close(x.grad, x_ref.grad, "input grad (all-reduced over the shards)")
        _close(layer.weight.grad, shard_tensor(w_full.grad, 0, rank, WORLD, sections), "weight grad")
        _close(layer.bias.grad, shard_tensor(b_full.grad, 0, rank, WORLD, sections), "bias grad")


def check_row_parallel_linear() -> None:
    from megatron.mpu import RowParallelLinear, get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    for input_is_parallel in (True, False):
        layer = RowParallelLinear(8, 5, name="row", init_fn=_normal(), seed=SEED, bias=True,
                                  input_is_parallel=input_is_parallel)
        with torch.no_grad():
            layer.bias.copy_(_same_inputs(5, seed=6))
        w_full = _full_weight("row.weight", (5, 8)).requires_grad_()
        b_full = _same_inputs(5, seed=6).requires_grad_()
        x_full = _same_inputs(3, 2, 8, seed=3)
        x_ref = x_full.clone().requires_grad_()
        grad_out = _same_inputs(3, 2, 5, seed=4)
        F.linear(x_ref, w_full, b_full).backward(grad_out)

        x = (x_full.chunk(WORLD, dim=-1)[rank] if input_is_parallel else x_full).clone().requires_grad_()
        y = layer(x)
        _close(y, F.linear(x_full, w_full.detach(), b_full.detach()), "output")
        y.backward(grad_out)
        want_x_grad = x_ref.grad.chunk(WORLD, dim=-1)[rank] if input_is_parallel else x_ref.grad
        _close(x.grad, want_x_grad, "input grad")
        _close(layer.weight.grad, w_full.grad.chunk(WORLD, dim=1)[rank], "weight grad")
        _close(layer.bias.grad, b_full.grad, "bias grad (replicated)")


def check_vocab_parallel_embedding() -> None:
    from megatron.mpu import VocabParallelEmbedding, get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    layer = VocabParallelEmbedding(12, 4, name="emb", init_fn=_normal(), seed=SEED)
    w_full = _full_weight("emb.weight", (12, 4)).requires_grad_()
    tokens = torch.tensor([[0, 5, 6, 11], [6, 6, 1, 7]])  # rows from both halves, repeats
    grad_out = _same_inputs(2, 4, 4, seed=7)
    F.embedding(tokens, w_full).backward(grad_out)
    y = layer(tokens)
    _close(y, w_full.detach()[tokens], "lookup")
    y.backward(grad_out)
    _close(layer.weight.grad, w_full.grad.chunk(WORLD, dim=0)[rank], "weight grad")


def check_vocab_parallel_cross_entropy() -> None:
    from megatron.mpu import (
        get_tensor_model_parallel_rank,
        vocab_parallel_cross_entropy,
    )

    rank = get_tensor_model_parallel_rank()
    # large offsets: exp() would overflow without subtracting the max across the group
    logits_full = _same_inputs(3, 5, 10, seed=8) * 4 + 500.0
    logits_full[1, 2, 7] += 40.0  # a dominant logit on rank 1's shard
    target = torch.tensor([[0, 9, 4, 5, 3], [1, 8, 7, 2, -100], [-100, 6, 5, 4, 0]])
    grad_out = _same_inputs(3, 5, seed=9)

    ref_in = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction="none", ignore_index=-100).view(3, 5)
    ref.backward(grad_out)

    # one block for all tokens, and blocks of 2 tokens (15 tokens: the last block is partial)
    for block_rows in (None, 2):
        shard = logits_full.chunk(WORLD, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, block_rows)
        assert torch.isfinite(loss).all()
        _close(loss, ref.detach(), f"loss (block_rows {block_rows})", atol=1e-4)
        loss.backward(grad_out)
        _close(shard.grad, ref_in.grad.chunk(WORLD, dim=-1)[rank], f"logits grad (block_rows {block_rows})")
    # half precision in, fp32 loss out, grad back in the input dtype
    half = logits_full.chunk(WORLD, dim=-1)[rank].to(torch.bfloat16).requires_grad_()
    vocab_parallel_cross_entropy(half, target).sum().backward()
    assert half.grad.dtype == torch.bfloat16
    # the z-loss's log Z over the whole vocabulary from the same pass, gradient softmax on each shard
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy_and_log_z

    ref_in = logits_full.double().requires_grad_()
    (torch.logsumexp(ref_in, dim=-1) * grad_out).sum().backward()
    shard = logits_full.chunk(WORLD, dim=-1)[rank].clone().requires_grad_()
    _, log_z = vocab_parallel_cross_entropy_and_log_z(shard, target, 2)
    _close(log_z.double(), torch.logsumexp(logits_full.double(), dim=-1), "log Z", atol=1e-4)
    (log_z * grad_out).sum().backward()
    _close(shard.grad.double(), ref_in.grad.chunk(WORLD, dim=-1)[rank], "log Z grad")


def check_fp16_cross_entropy_in_logits_dtype() -> None:
    """fp16_lm_cross_entropy at tp=2: GPT-NeoX's fp16 vocab-parallel cross-entropy (ea7aefd8 mpu/cross_entropy.py)
    written out on the full logits, each shard's exp-sum in fp16 and the two added in fp16 as its all-reduce does."""
    from megatron.mpu import get_tensor_model_parallel_rank
    from megatron.mpu.half_cross_entropy import vocab_parallel_cross_entropy_in_logits_dtype

    rank = get_tensor_model_parallel_rank()
    full = (_same_inputs(3, 5, 10, seed=8) * 4).half()
    target = torch.tensor([[0, 9, 4, 5, 3], [1, 8, 7, 2, 6], [3, 6, 5, 4, 0]])
    shifted = full - full.max(dim=-1)[0].unsqueeze(-1)
    parts = [torch.exp(piece).sum(dim=-1) for piece in shifted.chunk(WORLD, dim=-1)]
    expected = torch.log(parts[0] + parts[1]) - shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    shard = full.chunk(WORLD, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy_in_logits_dtype(shard, target)
    assert loss.dtype == torch.float16
    _close(loss.float(), expected.float(), "fp16 loss", atol=2e-3)
    loss.float().sum().backward()
    softmax = torch.softmax(full.float(), dim=-1) - F.one_hot(target, 10)
    _close(shard.grad.float(), softmax.chunk(WORLD, dim=-1)[rank], "fp16 logits grad", atol=2e-3)


def check_mappings() -> None:
    from megatron import mpu

    rank = mpu.get_tensor_model_parallel_rank()
    full = _same_inputs(4, 3, 6, seed=10)
    mine_last, mine_first = full.chunk(WORLD, dim=-1)[rank], full.chunk(WORLD, dim=0)[rank]
    g = _same_inputs(4, 3, 6, seed=11) + rank  # a different upstream gradient on each rank

    def run(fn: Callable, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    def summed(t: torch.Tensor) -> torch.Tensor:
        return torch.stack(_gather(t)).sum(0)

    y, dx = run(mpu.copy_to_tensor_model_parallel_region, full, g)
    _close(y, full, "copy fwd")
    _close(dx, summed(g), "copy bwd = all-reduce")
    y, dx = run(mpu.reduce_from_tensor_model_parallel_region, full * (rank + 1), g)
    _close(y, full * 3, "reduce fwd")
    _close(dx, g, "reduce bwd = identity")
    y, dx = run(mpu.scatter_to_tensor_model_parallel_region, full, g.chunk(WORLD, dim=-1)[rank])
    _close(y, mine_last, "scatter fwd")
    _close(dx, torch.cat(_gather(g.chunk(WORLD, dim=-1)[rank]), dim=-1), "scatter bwd = gather")
    y, dx = run(mpu.gather_from_tensor_model_parallel_region, mine_last, g)
    _close(y, full, "gather fwd")
    _close(dx, g.chunk(WORLD, dim=-1)[rank], "gather bwd = split")
    # sequence parallel: dim 0
    y, dx = run(mpu.scatter_to_sequence_parallel_region, full, g.chunk(WORLD, dim=0)[rank])
    _close(y, mine_first, "sp scatter fwd")
    _close(dx, torch.cat(_gather(g.chunk(WORLD, dim=0)[rank]), dim=0), "sp scatter bwd")
    y, dx = run(mpu.gather_from_sequence_parallel_region, mine_first, g)
    _close(y, full, "sp gather fwd")
    _close(dx, summed(g).chunk(WORLD, dim=0)[rank], "sp gather bwd = reduce-scatter")
    y, dx = run(lambda t: mpu.gather_from_sequence_parallel_region(t, grad_is_partial=False), mine_first, g)
    _close(dx, g.chunk(WORLD, dim=0)[rank], "sp gather bwd (full grads) = split")
    y, dx = run(mpu.reduce_scatter_to_sequence_parallel_region, full * (rank + 1), g.chunk(WORLD, dim=0)[rank])
    _close(y, (full * 3).chunk(WORLD, dim=0)[rank], "sp reduce-scatter fwd")
    _close(dx, torch.cat(_gather(g.chunk(WORLD, dim=0)[rank]), dim=0), "sp reduce-scatter bwd = gather")


def check_sequence_parallel_mlp_pair() -> None:
    """Column -> gelu -> row with sequence-sharded input/output equals the replicated pair."""
    from megatron.mpu import (
        ColumnParallelLinear,
        RowParallelLinear,
        get_tensor_model_parallel_rank,
    )
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

    rank = get_tensor_model_parallel_rank()
    x_full = _same_inputs(4, 2, 6, seed=12)
    g_full = _same_inputs(4, 2, 6, seed=13)
    grads = {}
    outputs = {}
    for sp in (False, True):
        col = ColumnParallelLinear(6, 8, name="c", init_fn=_normal(0.3), seed=SEED, sequence_parallel=sp)
        row = RowParallelLinear(8, 6, name="r", init_fn=_normal(0.3), seed=SEED, sequence_parallel=sp)
        with torch.no_grad():
            row.bias.copy_(_same_inputs(6, seed=14))
        x = (x_full.chunk(WORLD, dim=0)[rank] if sp else x_full).clone().requires_grad_()
        y = row(F.gelu(col(x)))
        y.backward(g_full.chunk(WORLD, dim=0)[rank] if sp else g_full)
        # the row bias sees a sequence shard: its gradient is partial until the trainer's tp sum
        sum_partial_grads_over_tensor_parallel([p.grad for p in partial_over_tensor_parallel(row)])
        outputs[sp] = y.detach() if not sp else torch.cat(_gather(y.detach()), dim=0)
        x_grad = x.grad if not sp else torch.cat(_gather(x.grad), dim=0)
        grads[sp] = [x_grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad]
    _close(outputs[True], outputs[False], "sp output")
    for name, a, b in zip(["x", "col.w", "col.b", "row.w", "row.b"], grads[True], grads[False]):
        _close(a, b, f"sp grad {name}")


def check_deepspeed_sees_tp_params() -> None:
    """DeepSpeed's own predicate classifies our params, so its grad norm counts each once."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megatron import mpu

    col = mpu.ColumnParallelLinear(4, 6, name="c", init_fn=_normal(), seed=SEED)
    row = mpu.RowParallelLinear(6, 4, name="r", init_fn=_normal(), seed=SEED)
    emb = mpu.VocabParallelEmbedding(8, 4, name="e", init_fn=_normal(), seed=SEED)
    assert is_model_parallel_parameter(col.weight) and is_model_parallel_parameter(col.bias)
    assert is_model_parallel_parameter(row.weight) and not is_model_parallel_parameter(row.bias)
    assert is_model_parallel_parameter(emb.weight)
    assert (col.weight.partition_dim, row.weight.partition_dim) == (0, 1)

    x = _same_inputs(2, 3, 4, seed=15)
    (row(col(emb(torch.tensor([[1, 7, 3]])) + x)) ** 2).sum().backward()
    # DeepSpeed's rule (runtime/utils.py, stage_1_and_2.py): count tp-replicated params on tp rank 0 only
    local = sum(
        p.grad.float().pow(2).sum()
        for p in [*col.parameters(), *row.parameters(), *emb.parameters()]
        if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)
    )
    total = torch.stack(_gather(local.reshape(1))).sum().sqrt()
    full = torch.cat(_gather(col.weight.grad), 0).pow(2).sum() + torch.cat(_gather(col.bias.grad)).pow(2).sum()
    full = full + torch.cat(_gather(row.weight.grad), 1).pow(2).sum() + row.bias.grad.pow(2).sum()
    full = full + torch.cat(_gather(emb.weight.grad), 0).pow(2).sum()
    _close(total, full.sqrt(), "grad norm")


def check_rng_tracker() -> None:
    """Default stream equal across tp ranks, tracked stream different; fork restores the default."""
    from megatron import mpu

    mpu.model_parallel_manual_seed(123)
    with mpu.tensor_parallel_rng():
        tracked = torch.rand(5)
    default = torch.rand(5)
    torch.manual_seed(123)
    assert torch.equal(default, torch.rand(5)), "fork changed the default stream"
    others_tracked, others_default = _gather(tracked), _gather(default)
    assert torch.equal(others_default[0], others_default[1])
    assert not torch.equal(others_tracked[0], others_tracked[1])
    # the tracker is DeepSpeed's, so its activation checkpointing replays the same stream
    from deepspeed.runtime.activation_checkpointing.checkpointing import (
        get_cuda_rng_tracker,
    )

    from megatron.mpu.random import MODEL_PARALLEL_RNG

    assert MODEL_PARALLEL_RNG in get_cuda_rng_tracker().get_states()


def check_reinit_tokens_on_vocabulary_shards() -> None:
    """``reinit_tokens`` on a vocabulary split over 2 ranks equals Levanter's rule on the whole matrix
    (levanter@9263f81e sft.py:353-360: truncated_normal(-3, 3) * std + mean, per hidden unit over the tokenizer's
    rows, population std), here computed on the full weight; the padding rows (13-15) are not counted."""
    from tokenizers import Tokenizer as HFJson
    from tokenizers import models

    from megatron.mpu import ColumnParallelLinear, VocabParallelEmbedding, get_tensor_model_parallel_rank
    from megatron.mpu.initialize_weights import param_generator
    from megatron.tokenizer.hf import HFBackedTokenizer
    from megatron.training.reinit_config import ReinitTokensArgs
    from megatron.training.reinit_tokens import reinit_tokens

    rank, vocab = get_tensor_model_parallel_rank(), ["<|endoftext|>"] + [f"t{i}" for i in range(12)]
    model = torch.nn.ModuleDict({
        "emb": VocabParallelEmbedding(16, 4, name="embedding.word_embeddings", init_fn=_normal(), seed=SEED),
        "out": ColumnParallelLinear(4, 16, name="output_layer", init_fn=_normal(), seed=SEED, bias=False)})
    tokenizer = HFBackedTokenizer(HFJson(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="t0")),
                                  fast=False)
    ids = [2, 10]  # one row on each rank
    reinit_tokens(model, ReinitTokensArgs(reinit_tokens=["t1", "t9"]), tokenizer, iteration=0, tied=False, seed=SEED)
    for key, name in (("emb", "embedding.word_embeddings.weight"), ("out", "output_layer.weight")):
        full = _full_weight(name, (16, 4))
        counted = full[:13].double()
        mu, std = counted.mean(0), counted.std(0, unbiased=False)
        z = torch.empty(2, 4)
        torch.nn.init.trunc_normal_(z, 0.0, 1.0, -3.0, 3.0, generator=param_generator(SEED, f"reinit_tokens.{name}"))
        expected = full.clone()
        expected[ids] = (z.double() * std + mu).float()
        _close(model[key].weight.detach(), expected.chunk(WORLD, dim=0)[rank], f"{name} shard")


CHECKS: dict[str, Callable[[], None]] = {
    "column_parallel_linear": check_column_parallel_linear,
    "row_parallel_linear": check_row_parallel_linear,
    "vocab_parallel_embedding": check_vocab_parallel_embedding,
    "vocab_parallel_cross_entropy": check_vocab_parallel_cross_entropy,
    "fp16_cross_entropy_in_logits_dtype": check_fp16_cross_entropy_in_logits_dtype,
    "mappings": check_mappings,
    "sequence_parallel_mlp_pair": check_sequence_parallel_mlp_pair,
    "deepspeed_sees_tp_params": check_deepspeed_sees_tp_params,
    "rng_tracker": check_rng_tracker,
    "reinit_tokens_on_vocabulary_shards": check_reinit_tokens_on_vocabulary_shards,
}


def _rank_main(rank: int, out_dir: str) -> None:
    run_tp_checks(rank, out_dir, WORLD, CHECKS)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("tp_layers"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_tp_layer(results: list[dict[str, str]], name: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == "ok", f"rank {rank}:\n{per_rank[name]}"
