"""Levanter's Kron (PSGD with Kronecker-factored preconditioners) as a torch optimizer, step by step as Levanter
writes it.

Read from stanford-crfm/levanter at 9263f81e, ``src/levanter/optim/kron.py``: ``KronConfig`` (kron.py:37-150: its
defaults, and the chain ``clip_by_global_norm(max_grad_norm)`` unless ``normalize_grads`` (kron.py:121),
``scale_by_kron``, ``clip_by_block_rms(1.1)`` (kron.py:150), ``add_decayed_weights``, ``scale_by_learning_rate``),
``precond_update_prob_schedule`` (kron.py:176-192), ``scale_by_kron``'s ``update_fn`` (kron.py:485-918) and its
helpers ``_get_preconditioner_types`` (1065-1086), ``_init_Q_exprs`` (1089-1197), ``_norm_lower_bound``
(1200-1220), ``_conjB`` (1247-1256), ``_update_precond`` (1259-1285), ``_precond_grad`` (1288-1291),
``BlockPartitioner`` (1332-1396), ``_merge_small_dims`` (1409-1475), ``_pad_and_stack_matrices`` (1478-1494). With ``t`` counting this step (the first
is 1), for every parameter::

    g  = g / (|g| + 1e-16)                                    (only with normalize_grads)
    mu = b1*mu + (1-b1)*g;  m = mu / (1 - b1**t)              (b1 = 0: m = g)
    m is reshaped (small dims merged towards target_merged_dim_size) and cut into block_size blocks along every
    triangular dimension, each block zero-padded to multiples of block_size (SOAP's layout, levanter_soap.Layout);
    each block keeps one factor per dimension: diagonal (a vector) for a dimension of size 1, longer than
    max_size_triangular, of a parameter with fewer than min_ndim_triangular dims, or chosen by memory_save_mode;
    else upper triangular; initialised to preconditioner_init_scale**(1/ndim) * ones / eye.
    once per step for all parameters (one counter, kron.py:825-836): counter += 1; when counter >= 1/p(t) (p(t) =
    clip(exp(-0.001*(t - update_prob_flat_start)), preconditioner_update_probability, 1), in float32) the counter
    is reset and every block's factors are updated: first balanced (each scaled to the geometric mean of their max
    |entries|) when a second counter reaches 100 updates, then with a Gaussian probe V of the padded blocks' shape,
    G = m + sqrt(eps_f32) * mean|m| * V (mean over the parameter's padded blocks), A = Q applied to G on every
    dim, conjB = V with inv(Q)^T applied on every dim, and per factor
        triangular: q -= lr_p / (norm_lower_bound(A_i A_i^T + B_i B_i^T) + tiny) * triu(A_i A_i^T - B_i B_i^T) @ q
        diagonal:   q -= lr_p / (max|a_i + b_i| + tiny) * (a_i - b_i) * q       (a_i = sum of A^2 over other dims)
    u  = (Q^T Q applied to m on every dim), unpadded and merged back to the parameter's shape
    u  = u / max(1, rms(u) / 1.1);  p <- p - lr * (u + wd * p)

Levanter's ``clip_by_global_norm(max_grad_norm)`` is DeepSpeed's ``gradient_clipping`` (a global clip before the
optimizer, as for SOAP).

Differences, deliberate:
- The probes: Levanter draws them with JAX's generator from one key split per step and per leaf
  (``_tree_random_like``); Deepy draws them with torch's generator seeded from (``seed``, the step, the parameter's
  place), :func:`draw_probes`, so a resumed run draws the same ones.
- Levanter stacks a model's layers into one array (haliax ``Stacked``, ``scanned_layers``) and maps the factors
  over the layers; only the damping's mean|m| then spans all layers of the stack. Deepy's layers are separate
  parameters, so it spans one layer.
- The matmul precisions (``precond_update_precision`` tensorfloat32, ``precond_grads_precision``) and ``mu_dtype``
  are not taken: the momentum is kept in the parameter's dtype (Levanter's default) and matmuls run at torch's own
  precision. The factors are float32 (Levanter's ``precond_dtype`` default; the constructor's ``precond_dtype``, which
  the formula test sets to float64).

Whole parameters (``megatron/engine/whole_parameters.py``, as SOAP): under tensor parallelism each split gradient is
all-gathered in the model's section order, every tp rank computes the same factors and update of the whole
parameter (the probe is drawn whole, from the same generator, on every rank) and keeps its slice; under ZeRO 1-3
(:meth:`LevanterKron.attach_zero`) each flat gradient partition is all-gathered over the data-parallel ranks and cut
into its whole parameters, and the rank keeps its partition of the flat update. A parameter's probe index is its
place in the model's parameter groups, fixed when the optimizer is built, so every layout draws the same probes.
DeepSpeed steps its groups one at a time (``stage_1_and_2.py`` ``_optimizer_step``), so the step and the two
counters are kept in every group and each group advances its own once per step (they agree: the schedule is
deterministic). A ZeRO-3 group split over several sub-groups (``sub_group_size`` smaller than a group) would
advance them twice: not supported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from megatron.engine.levanter_optim import closure_loss
from megatron.deepspeed_internals import ZeroMaster
from megatron.engine.levanter_soap import Layout, merge_small_dims
from megatron.engine.whole_parameters import TPSplit, ZeroWhole, tp_own, tp_split, tp_whole, zero_wholes

MEMORY_SAVE_MODES = (None, "one_diag", "all_diag")
DAMP_EPS = math.sqrt(float(torch.finfo(torch.float32).eps))
"""``jnp.sqrt(jnp.finfo(jnp.float32).eps)`` (kron.py:770)."""


def preconditioner_types(shape: tuple[int, ...], max_size: int, min_ndim: int, mode: str | None) -> list[bool]:
    """``_get_preconditioner_types`` (kron.py:1065-1086): True = a diagonal factor for that dimension."""
    if len(shape) == 0:
        return [True]
    if mode is None:
        diag = [False for _ in shape]
    elif mode == "one_diag":
        diag = [False for _ in shape]
        diag[int(np.argsort(shape)[::-1][0])] = True
    elif mode == "all_diag":
        diag = [True for _ in shape]
    else:
        raise ValueError(f"Invalid mem_save_mode: {mode}, must be one of [None, 'one_diag', 'all_diag']")
    for i, size in enumerate(shape):
        if size == 1 or size > max_size or len(shape) < min_ndim:
            diag[i] = True
    return diag


class KronLayout(Layout):
    """SOAP's reshaping (the same ``_merge_small_dims``, ``BlockPartitioner`` and padding in kron.py) with Kron's
    choice of diagonal dimensions: ``diag`` per dimension of the padded block."""

    def __init__(self, shape: tuple[int, ...], max_size: int, min_ndim: int, mode: str | None, merge: bool,
                 target: int, partition: bool, block_size: int) -> None:
        self.shape = tuple(int(d) for d in shape) or (1,)  # kron.py:545: a 0-d parameter as a 1-vector
        diag = preconditioner_types(self.shape, max_size, min_ndim, mode)
        merged = list(self.shape)
        if merge:
            merged, diag = merge_small_dims(self.shape, target, diag)
        self.merged = tuple(int(d) for d in merged)
        self.diag = list(diag)
        self.partition = partition
        self.splits: list[tuple[int, list[int]]] = []
        first = []
        for i, d in enumerate(self.merged):
            if partition and 0 < block_size < d and not diag[i]:
                n = (d - 1) // block_size
                self.splits.append((i, [block_size] * n + [d - n * block_size]))
                first.append(block_size)
            else:
                first.append(d)
        self.block = tuple(-(-d // block_size) * block_size for d in first) if partition else self.merged


def update_probability(step: int, min_prob: float, flat_start: int, max_prob: float = 1.0,
                       decay: float = 0.001) -> torch.Tensor:
    """``precond_update_prob_schedule`` (kron.py:176-192) at ``step``, in float32 as JAX computes it."""
    n = torch.tensor(float(step - flat_start), dtype=torch.float32)
    return torch.clamp(max_prob * torch.exp(-decay * n), min_prob, max_prob)


def draw_probes(seed: int, step: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The Gaussian probe of parameter ``index`` (its place over the parameter groups) at ``step``: float32, on the
    CPU, from torch's generator seeded by the three (Deepy's stand-in for ``_tree_random_like``)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + index)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _along(q: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``q`` (a diagonal vector or a matrix) applied to ``x`` along ``dim``: ``sum_n q[a, n] x[.., n, ..]``."""
    if q.ndim < 2:
        shape = [1] * x.ndim
        shape[dim] = -1
        return x * q.reshape(shape)
    return torch.movedim(torch.tensordot(q, x, dims=([1], [dim])), 0, dim)


def _gram(x: torch.Tensor, dim: int, diag: bool) -> torch.Tensor:
    """``exprGs[dim]`` (kron.py:1137, 1183): the sum over the other dims of x x^T (its diagonal when ``diag``)."""
    rows = torch.movedim(x, dim, 0).reshape(x.shape[dim], -1)
    return (rows * rows).sum(1) if diag else rows @ rows.T


def norm_lower_bound(a: torch.Tensor) -> torch.Tensor:
    """``_norm_lower_bound`` (kron.py:1200-1220): a cheap lower bound of the spectral norm of symmetric ``a``."""
    max_abs = a.abs().max()
    if max_abs <= 0:
        return max_abs
    a = a / max_abs
    i = torch.argmax((a * a).sum(0))
    x = a[:, i] @ a
    return max_abs * torch.linalg.vector_norm((x / torch.linalg.vector_norm(x)) @ a.T)


def conj_b(qs: list[torch.Tensor], g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``_conjB`` (kron.py:1247-1256)."""
    order = g.ndim
    c = v.permute(*range(1, order), 0)
    for i, q in enumerate(qs):
        if q.ndim < 2:
            c = c / q
        else:
            flat = c.reshape(-1, c.shape[-1])
            c = torch.linalg.solve_triangular(q, flat, upper=True, left=False).reshape(c.shape)
        if i < order - 1:
            c = c.transpose(i, order - 1)
    return c


def update_factors(qs: list[torch.Tensor], g: torch.Tensor, conjb: torch.Tensor,
                   precond_lr: float) -> list[torch.Tensor]:
    """``_update_precond`` (kron.py:1259-1285): every factor from the same A and conjB."""
    a = g
    for i, q in enumerate(qs):
        a = _along(q, a, i)
    out = []
    for i, q in enumerate(qs):
        diag = q.ndim < 2
        term1, term2 = _gram(a, i, diag), _gram(conjb, i, diag)
        tiny = torch.finfo(q.dtype).tiny
        if diag:
            out.append(q - precond_lr / ((term1 + term2).abs().max() + tiny) * (term1 - term2) * q)
        else:
            out.append(q - precond_lr / (norm_lower_bound(term1 + term2) + tiny) * torch.triu(term1 - term2) @ q)
    return out


def precondition(qs: list[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """``_precond_grad`` (kron.py:1288-1291): ``Q^T Q`` applied to ``g`` on every dim."""
    out = g
    for i, q in enumerate(qs):
        out = _along(q * q if q.ndim < 2 else q.T @ q, out, i)
    return out


def balance(qs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_balance_Q`` (kron.py:743-747): each factor scaled to the geometric mean of the factors' max |entry|."""
    norms = torch.stack([q.abs().max().to(torch.float32) for q in qs])
    gmean = torch.exp(torch.log(norms).mean())
    return [q * (gmean / n).to(q.dtype) for q, n in zip(qs, norms)]


class LevanterKron(torch.optim.Optimizer):
    """Levanter's ``KronConfig`` update (module docstring). State per parameter: ``mu`` (with ``beta1`` > 0) and
    ``Q`` (per block, one factor per dimension); the step and the two counters Levanter keeps once for all
    parameters are kept in every parameter group (``kron_step``, ``kron_update_counter``,
    ``kron_balance_counter``; they agree), so the state dict carries them."""

    def __init__(self, params: Iterable[Any], lr: float, beta1: float = 0.9, normalize_grads: bool = False,
                 preconditioner_update_probability: float = 0.05, update_prob_flat_start: int = 500,
                 max_size_triangular: int = 25000, min_ndim_triangular: int = 2, memory_save_mode: str | None = None,
                 preconditioner_lr: float = 0.1, preconditioner_init_scale: float = 1.0,
                 merge_small_dims: bool = True, target_merged_dim_size: int = 8192,
                 partition_grads_into_blocks: bool = True, block_size: int = 256, seed: int = 0,
                 weight_decay: float = 0.0, precond_dtype: torch.dtype = torch.float32) -> None:
        if memory_save_mode not in MEMORY_SAVE_MODES:
            raise ValueError(f"memory_save_mode must be one of {MEMORY_SAVE_MODES}, not {memory_save_mode!r}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.beta1 = beta1
        self.normalize_grads = normalize_grads
        self.min_prob = preconditioner_update_probability
        self.flat_start = update_prob_flat_start
        self.layout_args = (max_size_triangular, min_ndim_triangular, memory_save_mode, merge_small_dims,
                            target_merged_dim_size, partition_grads_into_blocks, block_size)
        self.precond_lr = preconditioner_lr
        self.init_scale = preconditioner_init_scale
        self.seed = seed
        self.precond_dtype = precond_dtype
        self.index: dict[int, int] = {}  # id of a model parameter -> its place over the groups (its probes)
        for group in self.param_groups:
            for key in ("kron_step", "kron_update_counter", "kron_balance_counter"):
                group.setdefault(key, 0)
            group["tp_splits"] = [tp_split(p) for p in group["params"]]  # before DeepSpeed swaps in copies
            for param in group["params"]:
                self.index.setdefault(id(param), len(self.index))
        self.zero: dict[int, ZeroWhole] = {}
        self.zero_index: dict[int, list[int]] = {}

    def attach_zero(self, masters: list[ZeroMaster]) -> None:
        """Step ZeRO's flat partitions through the whole parameters in them (``whole_parameters.ZeroWhole``), each
        with the probes of its model parameter."""
        self.zero = zero_wholes(masters)
        self.zero_index = {id(m.flat): [self.index[id(p)] for p in m.params] for m in masters}

    def layout(self, shape: tuple[int, ...]) -> KronLayout:
        return KronLayout(shape, *self.layout_args)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            if not group["params"]:  # ZeRO-3 empties the groups it is not stepping
                continue
            t, do_update, do_balance = self._advance(group)
            splits: list[TPSplit] = group.get("tp_splits") or [None] * len(group["params"])
            for param, split in zip(group["params"], splits):
                if param.grad is None:
                    continue
                state = self.state[param]
                flat = self.zero.get(id(param))
                if flat is None:  # a whole parameter, or a tensor-parallel slice of one
                    whole = tp_whole(param.grad, split)
                    update = tp_own(self._direction(whole, state, t, self.index[id(param)], do_update, do_balance),
                                    split)
                else:  # a ZeRO partition: each parameter in it whole (and its tp slice whole), state per parameter
                    states = state.setdefault("params", [{} for _ in flat.splits])
                    update = flat.shard([tp_own(self._direction(tp_whole(g, s), st, t, i, do_update, do_balance), s)
                                         for g, s, st, i in zip(flat.whole(param.grad), flat.splits, states,
                                                                self.zero_index[id(param)])], param)
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * param
                param.add_(update.reshape(param.shape), alpha=-group["lr"])
        return loss

    def _advance(self, group: dict[str, Any]) -> tuple[int, bool, bool]:
        """This step's number and whether the factors are updated (and balanced) this step (kron.py:825-836); the
        group's counters advanced."""
        t = int(group["kron_step"]) + 1
        group["kron_step"] = t
        counter = int(group["kron_update_counter"]) + 1
        do_update = bool(counter >= 1.0 / update_probability(t, self.min_prob, self.flat_start))
        do_balance = False
        if do_update:
            counter = 0
            balances = int(group["kron_balance_counter"]) + 1
            do_balance = balances >= 100
            group["kron_balance_counter"] = 0 if do_balance else balances
        group["kron_update_counter"] = counter
        return t, do_update, do_balance

    def _direction(self, grad: torch.Tensor, state: dict[str, Any], t: int, index: int, do_update: bool,
                   do_balance: bool) -> torch.Tensor:
        """``scale_by_kron`` then ``clip_by_block_rms(1.1)`` for one parameter."""
        layout = self.layout(tuple(grad.shape))
        if not state:
            if self.beta1 > 0:
                state["mu"] = torch.zeros_like(grad)
            n_blocks = len(layout.blocks(torch.zeros(layout.shape)))
            scale = self.init_scale ** (1.0 / len(layout.block))
            dev, dt = grad.device, self.precond_dtype
            state["Q"] = [[scale * (torch.ones(s, device=dev, dtype=dt) if diag else torch.eye(s, device=dev, dtype=dt))
                           for s, diag in zip(layout.block, layout.diag)] for _ in range(n_blocks)]
        g = grad
        if self.normalize_grads:
            g = g / (torch.linalg.vector_norm(g) + 1e-16)
        if self.beta1 > 0:
            mu = state["mu"]
            mu.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
            g = mu / (1.0 - self.beta1**t)
        blocks = layout.blocks(g.reshape(layout.shape))
        factors: list[list[torch.Tensor]] = state["Q"]
        if do_update:
            if do_balance:
                factors = [balance(qs) for qs in factors]
            probes = draw_probes(self.seed, t, index, (len(blocks), *layout.block)).to(g.device, g.dtype)
            damp = DAMP_EPS * torch.stack([b.abs().sum() for b in blocks]).sum() / probes.numel()
            new = []
            for qs, block, v in zip(factors, blocks, probes):
                damped = block + damp * v
                qs32 = [q.to(damped.dtype) for q in qs]
                new.append([q.to(self.precond_dtype) for q in
                            update_factors(qs32, damped, conj_b(qs32, damped, v), self.precond_lr)])
            factors = new
        state["Q"] = factors
        pre = [precondition([q.to(b.dtype) for q in qs], b) for qs, b in zip(factors, blocks)]
        u = layout.merge(pre).reshape(grad.shape)
        rms = torch.sqrt(torch.mean(u * u))
        return u / torch.clamp(rms / 1.1, min=1.0)
