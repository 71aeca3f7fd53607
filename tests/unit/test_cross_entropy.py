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
