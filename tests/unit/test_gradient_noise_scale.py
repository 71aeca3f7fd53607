"""The gradient noise scale (``log_gradient_noise_scale``) against McCandlish et al.'s estimator re-derived here, on
gradients whose per-sample parts the tests construct; and read from a real one-rank DeepSpeed engine.

The reference (arXiv:1812.06162, appendix A; GPT-NeoX ea7aefd8 megatron/gradient_noise_scale/): for a batch of B
samples, E|G_B|^2 = |G|^2 + tr(Sigma)/B. Two batch sizes give two equations in |G|^2 and tr(Sigma); solved:
|G|^2 = (B_big|G_big|^2 - B_small|G_small|^2)/(B_big - B_small), tr(Sigma) = (|G_small|^2 - |G_big|^2)/(1/B_small -
1/B_big); B_simple = tr(Sigma)/|G|^2. Each is smoothed by an EMA (beta) whose bias correction 1 - beta^(i+1) counts
the steps i so far; the ratio of the two corrected averages is what is logged."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from megatron.logging.config import LoggingArgs
from megatron.logging.monitor import build_monitor
from megatron.logging.noise_scale import GradientNoiseScale

BETA = 0.99


def step_gradient(per_sample: torch.Tensor) -> torch.Tensor:
    """One step's gradient: the mean of its samples' gradients (the loss is a mean over the batch)."""
    return per_sample.mean(dim=0)


def b_simple(per_sample_steps: list[torch.Tensor]) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimated from one window of steps: the last step is the small batch, all of the window's
    samples together the big one (the mean of the steps' means, all steps of equal size)."""
    b_small = per_sample_steps[0].shape[0]
    b_big = b_small * len(per_sample_steps)
    g_small = float(step_gradient(per_sample_steps[-1]).double().pow(2).sum())
    g_big = float(torch.cat(per_sample_steps).double().mean(dim=0).pow(2).sum())
    g2 = (b_big * g_big - b_small * g_small) / (b_big - b_small)
    trace = (g_small - g_big) / (1 / b_small - 1 / b_big)
    return g2, trace


def test_one_and_two_windows_match_the_estimator_rederived() -> None:
    torch.manual_seed(0)
    b, n, d = 4, 3, 6
    steps = [torch.randn(b, d) + torch.linspace(-1, 2, d) for _ in range(2 * n)]  # per-sample gradients
    gns = GradientNoiseScale(batch_size_small=b, n_batches=n, beta=BETA)
    for i, per_sample in enumerate(steps):
        gns.update([step_gradient(per_sample)[:2], step_gradient(per_sample)[2:]])  # two "parameters"
        assert (gns.noise_scale is None) == (i < n - 1)
        if i == n - 1:  # the first window: both averages carry the same correction, which the ratio cancels
            g2, trace = b_simple(steps[:n])
            assert gns.noise_scale == pytest.approx(trace / g2, rel=1e-5)
    # the second: EMA  a1 = (1-beta) y1, a2 = beta a1 + (1-beta) y2; the corrections (steps 2n) again cancel
    (g2_1, tr_1), (g2_2, tr_2) = b_simple(steps[:n]), b_simple(steps[n:])
    assert gns.noise_scale == pytest.approx((BETA * tr_1 + tr_2) / (BETA * g2_1 + g2_2), rel=1e-5)


def test_an_overflowed_step_is_left_out_and_not_counted() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(2, 5) + 1 for _ in range(2)]
    gns = GradientNoiseScale(batch_size_small=2, n_batches=2, beta=BETA)
    gns.update([step_gradient(steps[0])])
    gns.update([torch.full((5,), float("inf"))])  # an fp16 overflow: GPT-NeoX returns before counting it
    gns.update(None)
    assert gns.noise_scale is None and gns.n_updates == 1
    gns.update([step_gradient(steps[1])])
    g2, trace = b_simple(steps)
    assert gns.noise_scale == pytest.approx(trace / g2, rel=1e-5)


def test_it_finds_the_noise_scale_of_iid_gradients() -> None:
    """Per-sample gradients drawn from N(mu, s^2 I) in d dimensions: tr(Sigma) = d s^2, so the true
    B_simple = d s^2 / |mu|^2 (here 64 x 0.25 / 1 = 16); the EMA over windows averages the noise out."""
    gen = torch.Generator().manual_seed(2)
    d, s, b, n = 64, 0.5, 8, 4
    mu = torch.full((d,), 1 / d**0.5)  # |mu| = 1
    gns = GradientNoiseScale(batch_size_small=b, n_batches=n, beta=BETA)
    for _ in range(n * 600):
        gns.update([step_gradient(mu + s * torch.randn(b, d, generator=gen))])
    assert gns.noise_scale == pytest.approx(d * s**2 / float(mu.pow(2).sum()), rel=0.1)


def test_cpu_offload_keeps_the_buffer_on_the_host() -> None:
    """``gradient_noise_scale_cpu_offload``: the buffer is kept on the host, else beside the gradient (on a GPU
    the placement itself is checked)."""
    grads = [torch.ones(3, device="cuda" if torch.cuda.is_available() else "cpu")]
    off = GradientNoiseScale(batch_size_small=2, n_batches=3, cpu_offload=False)
    on = GradientNoiseScale(batch_size_small=2, n_batches=3, cpu_offload=True)
    off.update(grads)
    on.update(grads)
    assert on.buffer_device == torch.device("cpu") and off.buffer_device is None
    assert on.buffer is not None and off.buffer is not None
    assert on.buffer[0].device.type == "cpu" and off.buffer[0].device == grads[0].device
    assert on.buffer[0].data_ptr() != grads[0].data_ptr()  # a copy, never the live gradient


# ---- read from a real engine, through the keys --------------------------------------------------------------------

class Regression(torch.nn.Module):
    """Linear least squares: sample j's loss 0.5 (w.x_j - y_j)^2 has the gradient (w.x_j - y_j) x_j."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-0.5, 0.5, d))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((x @ self.w - y) ** 2).mean()


def test_the_engine_logs_the_noise_scale_of_its_gradients(one_rank: Any) -> None:
    """``log_gradient_noise_scale`` with ``gradient_noise_scale_n_batches`` 3 on a DeepSpeed engine whose update
    changes nothing (lr 0), so every sample's gradient is known in closed form; the clipping (tiny on purpose)
    comes after the gradient is read, and the value reaches the log row as train/noise_scale."""
    import deepspeed

    d, b, n = 5, 4, 3
    model = Regression(d)
    w = model.w.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config={"train_batch_size": b, "train_micro_batch_size_per_gpu": b,
                                              "gradient_clipping": 1e-3, "steps_per_print": 10**9})
    keys = LoggingArgs(log_gradient_noise_scale=True, gradient_noise_scale_n_batches=n,
                       gradient_noise_scale_cpu_offload=True, log_interval=1)
    monitor = build_monitor(keys, engine=engine, rank=0, speaks=True, start_iteration=0, train_iters=2 * n,
                            wandb_run_id=None, run_config={}, logger=logging.getLogger("test"), cuda=False,
                            wall_clock_breakdown=False)
    gen = torch.Generator().manual_seed(3)
    per_sample = []
    for step in range(1, 2 * n + 1):
        x, y = torch.randn(b, d, generator=gen), torch.randn(b, generator=gen)
        per_sample.append((x @ w - y)[:, None] * x)
        monitor.before_step(step)
        engine.backward(engine(x, y))
        engine.step()
        row = monitor.window_metrics(1)
        assert ("train/noise_scale" in row) == (step >= n)
    (g2_1, tr_1), (g2_2, tr_2) = b_simple(per_sample[:n]), b_simple(per_sample[n:])
    assert row["train/noise_scale"] == pytest.approx((BETA * tr_1 + tr_2) / (BETA * g2_1 + g2_2), rel=1e-5)
    assert torch.equal(model.w.detach(), w)  # lr 0: the gradients above are the ones the engine computed
    monitor.close(2 * n)
