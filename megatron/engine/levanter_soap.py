"""Levanter's SOAP (Shampoo's eigenbasis with Adam inside it) as a torch optimizer, step by step as Levanter writes it.

Read from stanford-crfm/levanter at 9263f81e, ``src/levanter/optim/soap.py`` (``scale_by_soap``, soap.py:111-661, and
its helpers). Each parameter is first reshaped: its small dimensions merged towards ``target_merged_dim_size``
(``_merge_small_dims``, soap.py:1036-1110: a 64x64 matrix becomes one 4096 vector, a 768x768 one stays), then cut into
blocks of ``block_size`` along every dimension shorter than ``max_precond_dim`` (``BlockPartitioner``,
soap.py:893-955), each block zero-padded to a multiple of ``block_size`` (``_pad_and_stack_matrices``). Every block
keeps, for each of its dimensions shorter than ``max_precond_dim`` (all of a vector's), a preconditioner ``GG`` (an
EMA of the gradient's outer product over the other dimensions) and its eigenbasis ``Q``. With ``t`` counting this
step (the first is 1)::

    t == 1:  GG = (1 - shampoo_beta) * outer(g);  Q = eigh(GG + eps*I) (eigenvalues descending);  u = 0
    t >= 2:  m  = b1*m + (1-b1)*g                                   (in the parameter's own basis)
             v  = b2*v + (1-b2)*project(g, Q)**2                    (in Q's basis, per block)
             u  = project_back(project(m, Q) / (sqrt(v) + eps), Q) * sqrt(1 - b2**t) / (1 - b1**t)
             GG = shampoo_beta*GG + (1-shampoo_beta)*outer(g)
             if t % precondition_frequency == 0:   # with the GG from BEFORE this step's update (soap.py:553-561)
                 Q's columns and v's entries sorted by diag(Q^T GG Q) descending, Q = qr(GG @ Q).Q

then Levanter's chain (soap.py:51-84): ``clip_by_global_norm(max_grad_norm)`` (DeepSpeed's ``gradient_clipping``),
this, ``add_decayed_weights`` and ``scale(-lr)``: ``p <- p - lr * (u + wd * p)``. The padded entries of ``v`` are
cut off after every step, as Levanter's unpadding does.

Whole tensors: the preconditioners act on whole blocks of each parameter, so every step runs on whole parameters
(``megatron/engine/whole_parameters.py``): under tensor parallelism each split parameter's gradient is all-gathered
over the tp ranks in the model's own order and the rank keeps its slice of the update; under ZeRO 1-3
(:meth:`LevanterSoap.attach_zero`, called when the engine is built) the flat gradient partition is all-gathered over
the data-parallel ranks and cut into the whole parameters, and the rank keeps its partition of the flat update. The
state is then whole on every rank that steps a part of the parameter. Weight decay is element-wise and needs nothing
gathered.

One deliberate difference: Levanter's ``update_step`` recomputes which dimensions get no preconditioner from the
merged shape (``>= max_precond_dim``) while its ``init_fn``/``init_step`` use the merge's own answer (all of the merged
dimensions had none); the two disagree only when small dimensions merge past ``max_precond_dim`` (Levanter's state
shapes then disagree too), and Deepy uses the merge's answer throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatron.deepspeed_internals import ZeroMaster
from megatron.engine.levanter_optim import closure_loss
from megatron.engine.whole_parameters import TPSplit, ZeroWhole, tp_own, tp_split, tp_whole, zero_wholes


def preconditioner_types(shape: tuple[int, ...], max_precond_dim: int, one_diag: bool) -> list[bool]:
    """``_get_preconditioner_types`` (soap.py:774-791): True = no preconditioner along that dimension."""
    if len(shape) <= 1:
        return [False]
    result = [s >= max_precond_dim for s in shape]
    if not one_diag:
        return result
    out, first = [], True
    for flag in result:
        if not flag and first:
            out.append(False)
            first = False
        else:
            out.append(True)
    return out


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every split of ``items`` into consecutive groups (``_partitions``, soap.py:958-965)."""
    if not items:
        yield [[]]
        return
    for i in range(len(items)):
        for rest in _partitions(items[i + 1:]):
            yield [items[:i + 1]] + rest


def merge_small_dims(shape: tuple[int, ...], target: int, null_dims: list[bool]) -> tuple[list[int], list[bool]]:
    """``_merge_small_dims`` (soap.py:1036-1110): consecutive dimensions merged to the split of least ``dim2loss``."""
    if not shape:
        return [], [True]
    if all(d == 1 for d in shape):
        return [1], [True]

    def dim2loss(d: float) -> float:
        loss = 0.0
        if d < target:
            loss += math.log2(target / d)
            if d < target / 8:
                loss += 100 * math.log2(target / 8 / d)
        else:
            loss += 10 * math.log2(d / target)
            if d > 8 * target:
                loss += 1000 * math.log2(d / (8 * target))
        return loss

    best, best_loss = [], float("inf")
    for split in _partitions(list(range(len(shape)))):
        groups = [g for g in split if g]
        loss = sum(dim2loss(math.prod(shape[i] for i in g)) for g in groups)
        if loss < best_loss:
            best, best_loss = groups, loss
    return ([math.prod(shape[i] for i in g) for g in best], [all(null_dims[i] for i in g) for g in best])


class Layout:
    """How one parameter's shape becomes blocks: merged shape, block splits, padded block shape, preconditioned dims."""

    def __init__(self, shape: tuple[int, ...], max_precond_dim: int, merge: bool, target: int, one_diag: bool,
                 partition: bool, block_size: int) -> None:
        self.shape = tuple(int(d) for d in shape) or (1,)  # a 0-d parameter as a 1-vector
        null = preconditioner_types(self.shape, max_precond_dim, one_diag)
        merged = list(self.shape)
        if merge:
            merged, null = merge_small_dims(self.shape, target, null)
        self.merged = tuple(int(d) for d in merged)
        self.partition = partition
        self.splits: list[tuple[int, list[int]]] = []  # (dim, sizes) of each split dimension, in order
        first = []
        for i, d in enumerate(self.merged):
            if partition and 0 < block_size < d and not null[i]:
                n = (d - 1) // block_size
                sizes = [block_size] * n + [d - n * block_size]
                self.splits.append((i, sizes))
                first.append(block_size)
            else:
                first.append(d)
        self.block = tuple(-(-d // block_size) * block_size for d in first) if partition else self.merged
        # init_conditioner (soap.py:855-890): a vector always; else each dim < max_precond_dim (one_diag: the first)
        if len(self.block) == 1:
            self.preconditioned = [True]
        else:
            self.preconditioned, open_ = [], True
            for s in self.block:
                take = s < max_precond_dim and (open_ or not one_diag)
                open_ = open_ and not take
                self.preconditioned.append(take)

    def blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``partition`` then ``_pad_and_stack_matrices``: the blocks in Levanter's order, each padded."""
        parts = [x.reshape(self.merged)]
        for dim, sizes in self.splits:
            parts = [piece for t in parts for piece in torch.split(t, sizes, dim=dim)]
        if not self.partition:
            return parts
        return [torch.nn.functional.pad(p, [v for d in reversed(range(p.ndim))
                                            for v in (0, self.block[d] - p.shape[d])]) for p in parts]

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """``_unstack_and_unpad_matrices`` then ``merge_partitions``, back to the parameter's shape."""
        sizes_of = {dim: sizes for dim, sizes in self.splits}
        shapes: list[list[int]] = [[]]  # each block's unpadded shape, in the order ``blocks`` made them
        for dim, d in enumerate(self.merged):
            options = sizes_of.get(dim, [d])
            shapes = [s + [o] for s in shapes for o in options]
        parts = [b[tuple(slice(0, n) for n in shape)] for b, shape in zip(blocks, shapes)]
        for dim, sizes in reversed(self.splits):
            n = len(sizes)
            parts = [torch.cat(parts[i:i + n], dim=dim) for i in range(0, len(parts), n)]
        return parts[0].reshape(self.shape)


def _outer(grad: torch.Tensor, idx: int) -> torch.Tensor:
    """``update_preconditioner``'s outer product over every dimension but ``idx`` (soap.py:667-693)."""
    if grad.ndim == 1:
        return torch.outer(grad, grad)
    others = [d for d in range(grad.ndim) if d != idx]
    return torch.tensordot(grad, grad, dims=(others, others))


def project(x: torch.Tensor, qs: list[torch.Tensor | None]) -> torch.Tensor:
    """``project`` (soap.py:696-714): each dimension in turn onto its ``Q`` (or moved to the end unchanged)."""
    for q in qs:
        x = torch.tensordot(x, q, dims=([0], [0])) if q is not None else x.permute(*range(1, x.ndim), 0)
    return x


def project_back(x: torch.Tensor, qs: list[torch.Tensor | None]) -> torch.Tensor:
    """``project_back`` (soap.py:717-735)."""
    for q in qs:
        x = torch.tensordot(x, q, dims=([0], [1])) if q is not None else torch.movedim(x, 0, -1)
    return x


class LevanterSoap(torch.optim.Optimizer):
    """Levanter's ``SoapConfig`` update (module docstring). State per parameter: ``step``, ``exp_avg``,
    ``exp_avg_sq`` (the parameter's shape), and per block ``GG`` and ``Q`` (one matrix per preconditioned dim)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], shampoo_beta: float,
                 eps: float, precondition_frequency: int, max_precond_dim: int, merge_small_dims: bool,
                 target_merged_dim_size: int, one_diag: bool, partition_grads_into_blocks: bool, block_size: int,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {
            "lr": lr, "betas": tuple(betas), "shampoo_beta": shampoo_beta if shampoo_beta >= 0 else betas[1],
            "eps": eps, "precondition_frequency": precondition_frequency, "max_precond_dim": max_precond_dim,
            "merge_small_dims": merge_small_dims, "target_merged_dim_size": target_merged_dim_size,
            "one_diag": one_diag, "partition_grads_into_blocks": partition_grads_into_blocks,
            "block_size": block_size, "weight_decay": weight_decay})
        for group in self.param_groups:  # the model's tp splits, before DeepSpeed swaps in copies without them
            group["tp_splits"] = [tp_split(p) for p in group["params"]]
        self.zero: dict[int, ZeroWhole] = {}

    def layout(self, shape: tuple[int, ...], group: dict[str, Any]) -> Layout:
        return Layout(shape, group["max_precond_dim"], group["merge_small_dims"], group["target_merged_dim_size"],
                      group["one_diag"], group["partition_grads_into_blocks"], group["block_size"])

    def attach_zero(self, masters: list[ZeroMaster]) -> None:
        """Step ZeRO's flat partitions (``deepspeed_internals.zero_masters`` of the engine's optimizer) through the
        whole parameters in them (``whole_parameters.ZeroWhole``)."""
        self.zero = zero_wholes(masters)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            splits: list[TPSplit] = group.get("tp_splits") or [None] * len(group["params"])
            for param, split in zip(group["params"], splits):
                if param.grad is None:
                    continue
                state = self.state[param]
                flat = self.zero.get(id(param))
                if flat is None:  # a whole parameter, or a tensor-parallel slice of one
                    update = tp_own(self._direction(tp_whole(param.grad, split), state, group), split)
                else:  # a ZeRO partition: each parameter in it whole (and its tp slice whole), state per parameter
                    states = state.setdefault("params", [{} for _ in flat.splits])
                    update = flat.shard([tp_own(self._direction(tp_whole(g, s), st, group), s)
                                         for g, s, st in zip(flat.whole(param.grad), flat.splits, states)], param)
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * param
                param.add_(update.reshape(param.shape), alpha=-group["lr"])
        return loss

    def _direction(self, whole_grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """SOAP's update of one whole parameter from its gradient; ``state`` is that parameter's."""
        b1, b2 = group["betas"]
        beta, eps = group["shampoo_beta"], group["eps"]
        layout = self.layout(tuple(whole_grad.shape), group)
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(whole_grad)
            state["exp_avg_sq"] = torch.zeros_like(whole_grad)
            state["GG"] = [[torch.zeros(s, s, dtype=whole_grad.dtype, device=whole_grad.device) if on else None
                            for s, on in zip(layout.block, layout.preconditioned)]
                           for _ in layout.blocks(whole_grad.reshape(layout.shape))]
            state["Q"] = [[None if m is None else torch.zeros_like(m) for m in gg] for gg in state["GG"]]
        t = int(state["step"]) + 1
        state["step"] = t
        shape = whole_grad.shape
        grad = whole_grad.reshape(layout.shape)
        g_blocks = layout.blocks(grad)
        if t == 1:  # init_step (soap.py:264-351): the preconditioners and their eigenbases; no update
            for gg_list, q_list, g in zip(state["GG"], state["Q"], g_blocks):
                for i, gg in enumerate(gg_list):
                    if gg is not None:
                        gg.lerp_(_outer(g, i), 1.0 - beta)
                        eye = torch.eye(gg.shape[0], dtype=gg.dtype, device=gg.device)
                        q_list[i] = torch.flip(torch.linalg.eigh(gg + eps * eye)[1], dims=[1])
            return torch.zeros_like(whole_grad)
        exp_avg = state["exp_avg"]
        exp_avg.mul_(b1).add_(grad.reshape(shape), alpha=1.0 - b1)
        m_blocks = layout.blocks(exp_avg.reshape(layout.shape))
        v_blocks = layout.blocks(state["exp_avg_sq"].reshape(layout.shape))
        corr = math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        refresh = t % group["precondition_frequency"] == 0
        updates, new_v = [], []
        for gg_list, q_list, g, m, v in zip(state["GG"], state["Q"], g_blocks, m_blocks, v_blocks):
            v = b2 * v + (1.0 - b2) * project(g, q_list) ** 2
            updates.append(project_back(project(m, q_list) / (v.sqrt() + eps), q_list) * corr)
            old = [None if gg is None else gg.clone() for gg in gg_list]
            for i, gg in enumerate(gg_list):
                if gg is not None:
                    gg.lerp_(_outer(g, i), 1.0 - beta)
            if refresh:  # get_orthogonal_matrix_QR (soap.py:749-771), with the GG from before this step
                for i, (mat, q) in enumerate(zip(old, q_list)):
                    if mat is None or q is None:
                        continue
                    est = torch.diagonal(q.T @ mat @ q)
                    order = torch.argsort(est, descending=True, stable=True)
                    v = torch.index_select(v, i, order)
                    q_list[i] = torch.linalg.qr(mat @ q[:, order])[0]
            new_v.append(v)
        state["exp_avg_sq"] = layout.merge(new_v).reshape(shape)
        return layout.merge(updates).reshape(shape)
