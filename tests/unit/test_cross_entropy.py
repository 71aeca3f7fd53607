"""The chunked cross-entropy on one rank equals torch's, whatever the block size and dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.mpu.cross_entropy import default_block_rows, vocab_parallel_cross_entropy


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 7, 50, generator=gen) * 5 + 300.0).to(dtype)  # large: needs the max shift
    target = torch.randint(0, 50, (3, 7), generator=gen)
    target[0, 2] = target[2, 6] = -100
    grad_out = torch.randn(3, 7, generator=gen)
    return logits, target, grad_out


@pytest.mark.parametrize("block_rows", [None, 1, 4, 21, 100])
def test_matches_torch_cross_entropy_fp32(block_rows: int | None) -> None:
    logits, target, grad_out = _case(torch.float32)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction="none").view(3, 7)
    ref.backward(grad_out)
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, block_rows)
    loss.backward(grad_out)
    torch.testing.assert_close(loss, ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, ref_in.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(x.detach(), logits), "the logits must not be modified in place"
    assert loss[0, 2] == 0 and (x.grad[0, 2] == 0).all()  # ignored target: no loss, no gradient


def test_bf16_in_fp32_loss_out_bf16_grad() -> None:
    logits, target, grad_out = _case(torch.bfloat16)
    ref_in = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction="none").view(3, 7)
    ref.backward(grad_out)
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, 4)
    loss.backward(grad_out)
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    # the loss is computed in fp32 from the bf16 values: as exact as the fp32 reference
    torch.testing.assert_close(loss, ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.float(), ref_in.grad, atol=4e-3, rtol=1e-2)


def test_default_block_size_on_cpu_follows_the_thread_count() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert default_block_rows(8192, torch.device("cpu")) == 32  # 32 x 8192 x 4 bytes = 1 MiB: in cache
        assert default_block_rows(10**8, torch.device("cpu")) == 1
        torch.set_num_threads(2)
        assert default_block_rows(8192, torch.device("cpu")) == 2048  # 64 MiB: few fork-joins
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_z_loss_equals_the_direct_formula(dtype: torch.dtype) -> None:
    """PaLM's z-loss, z * (log sum_v exp(logit_v))^2 per counted token, written out on an fp32 copy:
    the value and the gradient of the fused pass (log Z from the cross-entropy's own blocks) agree.
    The reference runs in fp64 (torch's fp32 logsumexp is itself 8e-5 off in the gradient at these
    large logits; the fused pass, 8e-7)."""
    from megatron.objectives import lm_loss_sum

    logits, target, _ = _case(dtype)
    z = 1e-2
    ref_in = logits.double().requires_grad_()
    counted = (target >= 0).double()
    ce = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction="none", ignore_index=-100).view(3, 7)
    ref_z = z * (torch.logsumexp(ref_in, dim=-1).square() * counted).sum()
    (ref_total := (ce * counted).sum() + ref_z).backward()
    x = logits.clone().requires_grad_()
    total, z_term = lm_loss_sum(x, target, z_loss=z)
    total.backward()
    torch.testing.assert_close(z_term.double(), ref_z.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), ref_total.detach(), rtol=1e-6, atol=0)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(x.grad.double(), ref_in.grad, **tol)
    # the z-loss's gradient is there: without it the logits' gradient differs
    x.grad = None
    lm_loss_sum(x, target)[0].backward()
    assert (x.grad.double() - ref_in.grad).abs().max() > 1e-2


def test_z_loss_keeps_no_fp32_copy_of_the_logits() -> None:
    """What autograd keeps for the backward of the loss with a z-loss, on bf16 logits: the logits
    themselves and per-token numbers, no fp32 tensor of the logits' size (4 x 8192 x 50k: 6.6 GB each)."""
    from megatron.objectives import lm_loss_sum

    logits, target, _ = _case(torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        total, _ = lm_loss_sum(x, target, z_loss=1e-2)
    big = [(t.dtype, tuple(t.shape)) for t in saved if t.numel() >= logits.numel()]
    assert big and all(dtype == torch.bfloat16 for dtype, _ in big), big
    total.backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
