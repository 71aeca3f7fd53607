"""The MoE layer on 2 real gloo ranks equals the single-process layer, forward and backward: experts
split over tensor-parallel ranks (with and without sequence parallelism) and over data-parallel
ranks exchanging tokens with all-to-all.

One spawn runs every check; each is reported as its own test.
"""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from rank_harness import finish_rank, record_checks, run_ranks

WORLD = 2
CFG = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=6, padded_vocab_size=32, seed=3,
           moe_num_experts=4, moe_top_k=2)  # fmt: skip


def _inputs(seed: int, s: int = 6, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, 16, generator=g), torch.randn(s, b, 16, generator=g)


def _layer(**overrides: object):
    from megatron.model import GPTConfig
    from megatron.model.moe import MoELayer

    layer = MoELayer(GPTConfig(**{**CFG, **overrides}), "layers.0.mlp", 0).train()
    experts = layer.experts
    with torch.no_grad():  # non-zero biases (by global expert id), so they are checked too
        for j in range(experts.w1.shape[0]):
            experts.w1_bias[j].fill_(0.01 * (experts.first_expert + j + 1))
            experts.w2_bias[j].fill_(-0.02 * (experts.first_expert + j + 1))
    return layer


def _reference(x: torch.Tensor, grad_out: torch.Tensor, **overrides: object):
    """The whole layer on one rank (call under ``_with_groups(1, 1)``): (layer, input, output),
    after the backward of ``grad_out``."""
    layer = _layer(**overrides)
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_out)
    return layer, x, out


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _with_groups(tp: int, ep: int) -> None:
    from megatron.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron.mpu.experts import initialize_expert_parallel

    destroy_model_parallel()
    initialize_model_parallel(tp, 0)
    initialize_expert_parallel(ep)


# --- the checks --------------------------------------------------------------------------------
def _check_tensor_parallel(sequence_parallel: bool, router: str, aux: float) -> None:
    """tp=2: each rank holds 2 whole experts; same tokens on both ranks."""
    from megatron.mpu import get_tensor_model_parallel_rank

    opts = dict(moe_router_type=router, moe_aux_loss_coeff=aux, moe_z_loss_coeff=aux / 10)
    x, grad_out = _inputs(7)
    _with_groups(1, 1)
    ref, x_ref, out_ref = _reference(x, grad_out, **opts)
    _with_groups(WORLD, 1)
    rank = get_tensor_model_parallel_rank()
    layer = _layer(sequence_parallel=sequence_parallel, **opts)
    if sequence_parallel:  # each rank holds its half of the sequence
        x_in = x.chunk(WORLD, 0)[rank].clone().requires_grad_()
        out = layer(x_in)
        _close(out, out_ref.detach().chunk(WORLD, 0)[rank], "output shard")
        out.backward(grad_out.chunk(WORLD, 0)[rank])
        _close(x_in.grad, x_ref.grad.chunk(WORLD, 0)[rank], "input grad shard")
    else:
        x_in = x.clone().requires_grad_()
        out = layer(x_in)
        _close(out, out_ref.detach(), "output")
        out.backward(grad_out)
        _close(x_in.grad, x_ref.grad, "input grad")
    _close(layer.router.weight.grad, ref.router.weight.grad, "router grad (complete on every rank)")
    mine = slice(2 * rank, 2 * rank + 2)
    for name in ("w1", "w2", "w1_bias", "w2_bias"):
        _close(getattr(layer.experts, name).grad, getattr(ref.experts, name).grad[mine], f"expert {name} grad")


def _check_expert_parallel(router: str, aux: float) -> None:
    """dp=2, ep=2: each rank routes its own tokens; rank r holds experts 2r, 2r+1."""
    from megatron.mpu import get_data_parallel_rank
    from megatron.mpu.experts import reduce_expert_gradients

    opts = dict(moe_router_type=router, moe_aux_loss_coeff=aux, moe_z_loss_coeff=aux / 10)
    per_rank = [_inputs(20 + r, s=4 + 2 * r) for r in range(WORLD)]  # uneven token counts
    _with_groups(1, 1)
    refs = [_reference(x, g, **opts) for x, g in per_rank]
    _with_groups(1, WORLD)
    rank = get_data_parallel_rank()
    layer = _layer(**opts)
    x, grad_out = per_rank[rank]
    x_in = x.clone().requires_grad_()
    out = layer(x_in)
    _close(out, refs[rank][2].detach(), "output")
    out.backward(grad_out)
    _close(x_in.grad, refs[rank][1].grad, "input grad")
    _close(layer.router.weight.grad, refs[rank][0].router.weight.grad, "router grad (this rank's tokens)")
    mine = slice(2 * rank, 2 * rank + 2)
    for name in ("w1", "w2", "w1_bias", "w2_bias"):
        # the all-to-all's backward brought every rank's contribution to the experts held here
        want = sum(getattr(ref.experts, name).grad[mine] for ref, _, _ in refs)
        _close(getattr(layer.experts, name).grad, want, f"expert {name} grad")
    reduce_expert_gradients(list(layer.experts.parameters()))  # the data-parallel mean
    _close(layer.experts.w1.grad, sum(ref.experts.w1.grad[mine] for ref, _, _ in refs) / WORLD, "reduced grad")


def check_expert_parallel_over_tp() -> None:
    _check_tensor_parallel(sequence_parallel=False, router="topk", aux=0.1)


def check_expert_parallel_over_tp_sequence_parallel() -> None:
    _check_tensor_parallel(sequence_parallel=True, router="sinkhorn", aux=0.1)


def check_expert_parallel_over_dp_all_to_all() -> None:
    _check_expert_parallel(router="topk", aux=0.1)


def check_expert_parallel_over_dp_sinkhorn() -> None:
    _check_expert_parallel(router="sinkhorn", aux=0.0)


def check_all_to_all_uneven_splits() -> None:
    """gloo's all_to_all_single with uneven (and empty) blocks, and its adjoint."""
    from megatron.mpu.experts import exchange_counts, exchange_tokens

    _with_groups(1, WORLD)
    rank = dist.get_rank()
    send = [[1, 3], [0, 2]][rank]  # rank 1 sends nothing to rank 0
    recv = [[1, 0], [3, 2]][rank]
    x = (torch.arange(sum(send), dtype=torch.float32) + 10 * rank).unsqueeze(1).requires_grad_()
    y = exchange_tokens(x, send, recv)
    want = {0: [0.0], 1: [1.0, 2.0, 3.0, 10.0, 11.0]}[rank]
    assert y.squeeze(1).tolist() == want, y
    (y * (torch.arange(y.shape[0]).unsqueeze(1) + 1)).sum().backward()
    # rows come back to their sender with the receiver's weights
    assert x.grad.squeeze(1).tolist() == {0: [1.0, 1.0, 2.0, 3.0], 1: [4.0, 5.0]}[rank], x.grad
    counts = exchange_counts(torch.tensor([[1, 2], [3, 4]]) + 10 * rank)
    assert counts.tolist() == ([[1, 2], [11, 12]] if rank == 0 else [[3, 4], [13, 14]])


CHECKS: dict[str, Callable[[], None]] = {
    "expert_parallel_over_tp": check_expert_parallel_over_tp,
    "expert_parallel_over_tp_sequence_parallel": check_expert_parallel_over_tp_sequence_parallel,
    "expert_parallel_over_dp_all_to_all": check_expert_parallel_over_dp_all_to_all,
    "expert_parallel_over_dp_sinkhorn": check_expert_parallel_over_dp_sinkhorn,
    "all_to_all_uneven_splits": check_all_to_all_uneven_splits,
}


def _rank_main(rank: int, out_dir: str) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    finish_rank(out_dir, rank, record_checks(CHECKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("moe_parallel"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_moe_parallel(results: list[dict[str, str]], name: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == "ok", f"rank {rank}:\n{per_rank[name]}"
