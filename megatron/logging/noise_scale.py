"""The gradient noise scale (``log_gradient_noise_scale``), as GPT-NeoX's ``GradientNoiseScale`` computes it.

McCandlish et al. 2018 (arXiv:1812.06162): the simple noise scale B_simple = tr(Sigma) / |G|^2 estimates the
critical batch size. With the squared norm of a small batch's gradient (B_small samples) and of a large batch's
(B_big samples), each unbiased estimator is

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

GPT-NeoX ea7aefd8 (megatron/gradient_noise_scale/gradient_noise_scale.py) takes the small batch to be one step
(B_small = train_batch_size) and the large batch to be the mean of ``n_batches`` steps' gradients in a row
(B_big = n_batches x B_small): every step's gradient is added to a buffer; at each ``n_batches``-th step the buffer
is divided by n_batches and, with that step's own gradient, gives both estimators, computed in fp32; each is
smoothed by an exponential moving average (beta 0.99) whose bias correction counts *steps* (``1 - beta^(i+1)``
with ``i`` the updates so far, not the estimates), and B_simple is the ratio of the two corrected averages. A
step whose gradient holds an inf or a NaN (an fp16 overflow) is left out: not added, not counted.

Where Deepy differs, and why:

- The gradient is the one the optimizer receives (averaged over data parallelism, before clipping, the fp16
  loss scale removed), read through DeepSpeed's ``safe_get_full_grad`` in the same wrapper around the optimizer's
  step the ``log_*`` statistics use (``stats.py``), so every ZeRO stage works. GPT-NeoX reads DeeperSpeed's
  ``engine.stored_gradients`` (``p.grad`` cloned after fp32 clipping, before the step; DeeperSpeed 579e8724), which
  the DeeperSpeed it pins (91d1c55) no longer has, and its ``get_noise_scale_logger`` (megatron/utils.py:383) names
  an undefined ``model``: at ea7aefd8 the key fails at start; it also refuses ZeRO stages >= 1.
- The squared norms are of the whole model: tensor-parallel shards are added up (a replicated parameter counted
  once) and pipeline stages summed. GPT-NeoX averages its stages' squared norms (a common factor, which the
  ratio cancels) and, outside a pipeline, reads rank 0's own tensor-parallel shard only.
- It is logged as ``train/noise_scale`` (GPT-NeoX's name) at log steps, the newest estimate; GPT-NeoX logs it
  every step. B_small is the engine's ``train_batch_size`` when the run starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import safe_get_full_grad

from megatron import mpu

BETA = 0.99
"""GPT-NeoX's EMA coefficient (``GradientNoiseScale(beta=0.99)``; ``get_noise_scale_logger`` keeps the default)."""


def ema(avg: float | None, beta: float, y: float, i: int) -> tuple[float, float]:
    """GPT-NeoX's ``ema``: the new average and its bias-corrected value after update number ``i`` (0-based)."""
    avg = beta * (avg or 0.0) + (1 - beta) * y
    return avg, avg / (1 - beta ** (i + 1))


class GradientNoiseScale:
    """The estimator, fed one step's gradient at a time (this rank's pieces of it, or None for an overflow).

    ``total``: sums a pair of this rank's squared norms over the model's ranks (identity on one rank)."""

    def __init__(self, batch_size_small: int, n_batches: int, beta: float = BETA, cpu_offload: bool = False,
                 total: Callable[[torch.Tensor], torch.Tensor] = lambda sq: sq) -> None:
        if n_batches < 2:
            raise ValueError(f"n_batches={n_batches}: the large batch must hold more than one step's gradient")
        self.batch_size_small = batch_size_small
        self.batch_size_large = batch_size_small * n_batches
        self.n_batches = n_batches
        self.beta = beta
        self.buffer_device = torch.device("cpu") if cpu_offload else None
        """Where the buffer lives: the host with ``gradient_noise_scale_cpu_offload``, else beside the gradient."""
        self.total = total
        self.buffer: list[torch.Tensor] | None = None
        self.ema_scale: float | None = None
        self.ema_noise: float | None = None
        self.noise_scale: float | None = None
        """B_simple, once the first ``n_batches`` steps are in (None before)."""
        self.n_updates = 0

    def update(self, grads: list[torch.Tensor] | None) -> None:
        """One step's gradient, None (or a non-finite one) when the step overflowed."""
        if grads is None or not all(bool(torch.isfinite(g).all()) for g in grads):
            return
        # fp32 copies (GPT-NeoX: "this needs to be done in fp32 or it overflows"); never the live gradient
        grad = [g.detach().to(device=self.buffer_device or g.device, dtype=torch.float32, copy=True) for g in grads]
        if self.buffer is None:
            self.buffer = [g.clone() for g in grad]
        else:
            for b, g in zip(self.buffer, grad):
                b += g
        if self.n_updates % self.n_batches == self.n_batches - 1:
            big = [b / self.n_batches for b in self.buffer]
            self.buffer = None
            squares = torch.stack([_sq(big), _sq(grad)])
            g_big, g_small = (float(x) for x in self.total(squares))
            self._estimate(g_big, g_small)
        self.n_updates += 1

    def _estimate(self, g_big: float, g_small: float) -> None:
        b_small, b_big = self.batch_size_small, self.batch_size_large
        noise = (b_big * g_big - b_small * g_small) / (b_big - b_small)  # |G|^2
        scale = (g_small - g_big) / (1 / b_small - 1 / b_big)  # tr(Sigma)
        self.ema_noise, noise = ema(self.ema_noise, self.beta, noise, self.n_updates)
        self.ema_scale, scale = ema(self.ema_scale, self.beta, scale, self.n_updates)
        self.noise_scale = scale / noise


def _sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        out += t.double().pow(2).sum().cpu()
    return out


class NoiseScaleLogger:
    """Feeds :class:`GradientNoiseScale` every step's gradient, read in a wrapper around the engine's optimizer
    step (and, for fp32 without ZeRO, around its clipping, which comes first), as ``stats.StatsCollector`` does."""

    def __init__(self, engine: Any, n_batches: int, cpu_offload: bool) -> None:
        self.engine = engine
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        # a parameter replicated over tensor parallelism is counted on tensor-parallel rank 0 only
        self.counted = [is_model_parallel_parameter(p) or mpu.get_tensor_model_parallel_rank() == 0
                        for p in self.params]
        self.estimate = GradientNoiseScale(int(engine.train_batch_size()), n_batches, cpu_offload=cpu_offload,
                                           total=self._total)
        self._read = False
        self._wrap(engine.optimizer, "step")
        self._wrap(engine, "clip_fp32_gradients")

    def _wrap(self, owner: Any, method: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self._read:
                self._read = True
                self.estimate.update(self._grads())
            return inner(*args, **kwargs)

        setattr(owner, method, wrapped)

    def arm(self) -> None:
        """Call before each step: the step's gradient is read once, at its first wrapped call."""
        self._read = False

    @property
    def noise_scale(self) -> float | None:
        return self.estimate.noise_scale

    def _grads(self) -> list[torch.Tensor] | None:
        """This rank's counted pieces of the step's gradient; None when any rank of the model holds an inf or a
        NaN (GPT-NeoX's ``_sync_overflow``), so every rank leaves the same steps out."""
        scale = _loss_scale(self.engine)
        out = []
        for p, counted in zip(self.params, self.counted):
            grad = safe_get_full_grad(p)  # a collective under ZeRO: every rank calls it, in order
            if grad is not None and counted:
                out.append(grad.detach().float() / scale)
        bad = torch.tensor([float(sum(not bool(torch.isfinite(g).all()) for g in out))], dtype=torch.float64)
        return None if float(self._total(bad)[0]) > 0 else out

    def _total(self, squares: torch.Tensor) -> torch.Tensor:
        """Sum of the squared norms over tensor-parallel shards and pipeline stages."""
        groups = [(mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group),
                  (mpu.get_pipe_parallel_world_size(), mpu.get_pipe_parallel_group)]
        for size, group_of in groups:
            if size > 1:
                group = group_of()
                # on the device the backend moves (NCCL refuses a host tensor)
                on_device = squares.to(mpu.collective_device(group))
                dist.all_reduce(on_device, group=group)
                squares = on_device.cpu()
        return squares


def _loss_scale(engine: Any) -> float:
    """fp16 gradients carry the loss scale until DeepSpeed's step divides it out (as ``StatsCollector`` reads it)."""
    if not engine.fp16_enabled():
        return 1.0
    optimizer = engine.optimizer
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale else 1.0
