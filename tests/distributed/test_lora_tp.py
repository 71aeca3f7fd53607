"""LoRA adapters split like the layer they adapt, on 2 real gloo ranks: output and gradients equal the
direct full computation ``scale * x A^T B^T`` (plain torch, one process), with and without sequence
parallelism, for a fused (sectioned) column-parallel layer (one adapter, or one per section), a row-parallel
layer and the untied output head (vocab-parallel logits).

One spawn runs every check; each is reported as its own test.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rank_harness import run_ranks, run_tp_checks

WORLD = 2
SEED = 5
R, ALPHA = 3, 6.0


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.mpu import get_tensor_model_parallel_group

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous(), group=get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sections: list[int] | None) -> torch.Tensor:
    """The direct computation: ``scale B A x``, or with ``sections`` one rank-R update per section (A_s: R rows of
    ``a`` each, B_s: the section's rows of ``b``), concatenated: Levanter's separate LowRankLinears."""
    if sections is None:
        return F.linear(F.linear(x, a), b) * (ALPHA / R)
    parts = [F.linear(F.linear(x, a_s), b_s) for a_s, b_s in zip(a.split(R), b.split(sections))]
    return torch.cat(parts, dim=-1) * (ALPHA / R)


def _check(column: bool, sequence_parallel: bool, split: bool = False) -> None:
    from megatron.model.lora import LoRAAdapter
    from megatron.model.lora_config import LoRAArgs
    from megatron.mpu import ColumnParallelLinear, RowParallelLinear, get_tensor_model_parallel_rank
    from megatron.mpu.initialize_weights import init_method_from_name, shard_tensor

    rank = get_tensor_model_parallel_rank()
    init = init_method_from_name("normal", 0.02, 2, 8)
    sections = [4, 2, 2] if column else None
    d_in, d_out = (6, 8) if column else (8, 6)
    layer: ColumnParallelLinear | RowParallelLinear
    if column:
        layer = ColumnParallelLinear(d_in, d_out, name="c", init_fn=init, seed=SEED, sections=sections,
                                     sequence_parallel=sequence_parallel)
    else:
        layer = RowParallelLinear(d_in, d_out, name="r", init_fn=init, seed=SEED, sequence_parallel=sequence_parallel)
    adapter = LoRAAdapter(layer, LoRAArgs(lora_r=R, lora_alpha=ALPHA, lora_split_fused=split), SEED)
    # split: GQA-like sections [q 4, k 2, v 2], each with its own adapter (A_s stacked: [3 R, in])
    a_full, b_full = _rand(3 * R if split else R, d_in, seed=1), _rand(d_out, R, seed=2)
    with torch.no_grad():  # known full factors, sharded the way the adapter's layer is
        adapter.lora_A.copy_(a_full if column else shard_tensor(a_full, 1, rank, WORLD))
        adapter.lora_B.copy_(shard_tensor(b_full, 0, rank, WORLD, sections) if column else b_full)

    x_full, g_full = _rand(4, 2, d_in, seed=3), _rand(4, 2, d_out, seed=4)  # [s, b, in], [s, b, out]
    a_ref, b_ref = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    y_ref = _low_rank(x_ref, a_ref, b_ref, sections if split else None)
    y_ref.backward(g_full)

    # what this rank's adapter sees and returns
    if column:
        x = x_full.chunk(WORLD, 0)[rank] if sequence_parallel else x_full
        g = shard_tensor(g_full, 2, rank, WORLD, sections)
        want_y = shard_tensor(y_ref.detach(), 2, rank, WORLD, sections)
    else:
        x = x_full.chunk(WORLD, 2)[rank]
        g = g_full.chunk(WORLD, 0)[rank] if sequence_parallel else g_full
        want_y = y_ref.detach().chunk(WORLD, 0)[rank] if sequence_parallel else y_ref.detach()
    x = x.clone().requires_grad_()
    y = adapter(x)
    _close(y, want_y, "adapter output")
    y.backward(g)
    # the replicated factor meets a sequence shard under sequence parallelism: the trainer's tp sum
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

    sum_partial_grads_over_tensor_parallel([p.grad for p in partial_over_tensor_parallel(adapter)])
    if column:
        _close(adapter.lora_A.grad, a_ref.grad, "A grad (replicated, summed over tp)")
        _close(adapter.lora_B.grad, shard_tensor(b_ref.grad, 0, rank, WORLD, sections), "B grad shard")
        x_grad = _gather(x.grad, 0) if sequence_parallel else x.grad
        # the adapter's share of the input gradient; the base layer adds its own
        _close(x_grad, x_ref.grad, "input grad")
    else:
        _close(adapter.lora_A.grad, shard_tensor(a_ref.grad, 1, rank, WORLD), "A grad shard")
        _close(adapter.lora_B.grad, b_ref.grad, "B grad (replicated)")
        _close(_gather(x.grad, 2), x_ref.grad, "input grad")
    # the whole layer: base output plus the adapter term, through the hook apply_lora installs
    from megatron.model.lora import _add_adapter_output

    layer.add_module("adapter", adapter)
    layer.register_forward_hook(_add_adapter_output)
    with torch.no_grad():
        both = layer(x.detach())
        layer.adapter.enabled = False
        base = layer(x.detach())
    _close(both - base, want_y, "hooked layer minus base")


def _check_head(sequence_parallel: bool) -> None:
    """The untied head's adapter: hidden [s, b, h] -> logits [b, s, v/tp], B split by vocabulary rows."""
    from megatron.model.gpt import OutputLayer
    from megatron.model.lora import LoRAAdapter
    from megatron.model.lora_config import LoRAArgs
    from megatron.mpu import get_tensor_model_parallel_rank
    from megatron.mpu.initialize_weights import init_method_from_name

    rank = get_tensor_model_parallel_rank()
    d_in, vocab = 6, 8
    head = OutputLayer(d_in, vocab, name="output_layer", init_fn=init_method_from_name("normal", 0.02, 2, 8),
                       seed=SEED, bias=False, sequence_parallel=sequence_parallel)
    adapter = LoRAAdapter(head, LoRAArgs(lora_r=R, lora_alpha=ALPHA, lora_init="levanter"), SEED)
    a_full, b_full = _rand(R, d_in, seed=1), _rand(vocab, R, seed=2)
    with torch.no_grad():
        adapter.lora_A.copy_(a_full)
        adapter.lora_B.copy_(b_full.chunk(WORLD, 0)[rank])
    x_full, g_full = _rand(4, 2, d_in, seed=3), _rand(2, 4, vocab, seed=4)  # [s, b, h], [b, s, v]
    a_ref, b_ref, x_ref = (t.clone().requires_grad_() for t in (a_full, b_full, x_full))
    y_ref = _low_rank(x_ref.transpose(0, 1), a_ref, b_ref, None)  # [b, s, v]
    y_ref.backward(g_full)
    x = (x_full.chunk(WORLD, 0)[rank] if sequence_parallel else x_full).clone().requires_grad_()
    y = adapter(x)
    _close(y, y_ref.detach().chunk(WORLD, 2)[rank], "head adapter logits (this rank's vocabulary)")
    y.backward(g_full.chunk(WORLD, 2)[rank])
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel

    sum_partial_grads_over_tensor_parallel([p.grad for p in partial_over_tensor_parallel(adapter)])
    _close(adapter.lora_A.grad, a_ref.grad, "head A grad (replicated, summed over tp)")
    _close(adapter.lora_B.grad, b_ref.grad.chunk(WORLD, 0)[rank], "head B grad shard")


CHECKS = {
    "column_sectioned": lambda: _check(column=True, sequence_parallel=False),
    "column_split_by_sections": lambda: _check(column=True, sequence_parallel=False, split=True),
    "column_split_sequence_parallel": lambda: _check(column=True, sequence_parallel=True, split=True),
    "head": lambda: _check_head(sequence_parallel=False),
    "head_sequence_parallel": lambda: _check_head(sequence_parallel=True),
    "column_sequence_parallel": lambda: _check(column=True, sequence_parallel=True),
    "row": lambda: _check(column=False, sequence_parallel=False),
    "row_sequence_parallel": lambda: _check(column=False, sequence_parallel=True),
}


def _rank_main(rank: int, out_dir: str) -> None:
    run_tp_checks(rank, out_dir, WORLD, CHECKS)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("lora_tp"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_lora_adapter_split(results: list[dict[str, str]], name: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == "ok", f"rank {rank}:\n{per_rank[name]}"
