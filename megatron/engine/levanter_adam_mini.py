"""Levanter's Adam-mini (``MiniConfig``, ``src/levanter/optim/adam_mini.py`` of stanford-crfm/levanter@9263f81e) as a
torch optimizer, its update exactly as Levanter writes it.

Levanter labels each parameter by its path (``create_mask``, adam_mini.py:82-105) and chains, per label
(adam_mini.py:44-74):

* the "mini" labels (``embedding``, ``lm_head``, ``query``, ``key``, ``value``, ``output``, and ``linear``: the
  weight of any other ``Linear``): ``scale_with_mini`` (adam_mini.py:121-176), then
  ``add_decayed_weights(weight_decay, mask)`` and ``scale(-lr)``; no clipping. With ``t`` counted from 1::

      m = b1 * m + (1 - b1) * g
      v = b2 * v + (1 - b2) * mean_block(g**2)      (one value per block, repeated over it)
      u = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)

* ``adamw`` (norms, the biases of other ``Linear`` layers, anything else): ``clip_by_global_norm(max_grad_norm)`` over
  these parameters' gradients only (``optax.multi_transform`` hands each label its own leaves), ``scale_by_adam``,
  decay, ``scale(-lr)``.

The blocks are the axes Levanter averages over in its stacked, out-first Llama-family arrays (a leading layer axis;
``q_proj`` out = (kv_heads, q_heads_per_group, head_size), ``k_proj``/``v_proj`` out = (kv_heads, head_size),
``o_proj`` in = (heads, head_size); llama.py:264-266, 446, 503): embeddings and ``lm_head`` one block per vocabulary
row (mean over axis 1); ``q_proj`` one block per (layer, kv head) over the query heads of its group and the input
(axes 2, 3, 4), its bias one per kv head; ``k_proj`` one block per (layer, kv head) (axes 2, 3), its bias likewise;
``v_proj`` one block per output row (axis 3), its bias element-wise (axis 3 does not exist); ``o_proj`` one block per
output row (axes 2, 3), its bias element-wise; other ``Linear`` weights one block per output row (axis 2).
Deepy's fused ``query_key_value`` holds ``[q (heads * d); k (kv * d); v (kv * d)]`` rows with query head ``i`` in kv
group ``i // (heads / kv)`` (megatron/model/attention.py), so each of those blocks is a run of consecutive rows:
a parameter's blocks are row counts along its first dimension, each block spanning every other dimension.

Levanter's ``lr: 0.02`` and ``nesterov`` fields are never read by ``build`` (it schedules ``learning_rate``).
Tensor parallelism: a column-parallel layer's slice (``query_key_value``, ``dense_h_to_4h``, the vocabulary-parallel
embedding and output layer) holds whole rows, and whole kv groups of the fused ``[q; k; v]`` (its sections are cut
per rank, ``mpu.initialize_weights.shard_tensor``; the head layout is this rank's); a row-parallel layer's
(``attention.dense``, ``dense_4h_to_h``: split along dim 1) row sums of squares are added over the tp ranks; the
``adamw`` clip's norm adds the split parameters' squares over the tp ranks (``global_norm``). ZeRO 1-3: each flat
partition's gradient is gathered whole over the data-parallel ranks (``whole_parameters.ZeroWhole``) for the block
means; the moments stay element-wise on the partition (a block's second moment repeated over its elements, the same
numbers); the ``adamw`` clip's norm is taken over every group before DeepSpeed steps them (``before_zero_step``).
Pipelines (part of the ``adamw`` clip's parameters) are refused before launch (``optimizer_checks``); Levanter's
GPT-2 (fused ``c_attn``, in-first) is refused by the Levanter dialect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron.engine.levanter_optim import closure_loss
from megatron.engine.levanter_whole_tensor_optim import (_adam_direction, _decay_and_step, _RoleOptimizer, _tp,
                                                          clip_by_global_norm, tp_dim)

HeadLayout = tuple[int, int, int]
"""(query heads, kv heads, head size) of an attention's fused ``query_key_value``."""


def qkv_head_layouts(model: torch.nn.Module) -> dict[torch.Tensor, HeadLayout]:
    """Each fused ``query_key_value`` weight and bias of ``model`` -> its attention's (heads, kv heads, head size)."""
    layouts: dict[torch.Tensor, HeadLayout] = {}
    fields = ("heads", "kv_heads", "head_dim")
    for module in model.modules():
        qkv = getattr(module, "query_key_value", None)
        if qkv is None or not all(hasattr(module, a) for a in fields):
            continue
        heads, kv, d = (int(getattr(module, a)) for a in fields)
        for param in (getattr(qkv, "weight", None), getattr(qkv, "bias", None)):
            if isinstance(param, torch.Tensor):
                layouts[param] = (heads, kv, d)
    return layouts


def mini_blocks(name: str, param: torch.Tensor, layout: HeadLayout | None) -> list[int] | None:
    """The parameter's blocks as row counts along its first dimension (module docstring), or None for ``adamw``."""
    rows = int(param.shape[0]) if param.dim() else 1
    lowered = name.lower()
    per_row = [1] * rows
    if "embedding" in lowered or "output_layer" in lowered:  # "embedding", "lm_head": mean over axis 1
        return per_row
    if lowered.endswith("query_key_value.weight") or lowered.endswith("query_key_value.bias"):
        if layout is None:
            raise ValueError(f"Adam-mini needs the head layout of {name}")
        heads, kv, d = layout
        return [heads // kv * d] * kv + [d] * kv + [1] * (kv * d)  # query per kv group, key per kv head, value rows
    if lowered.endswith("attention.dense.weight") or lowered.endswith("attention.dense.bias"):
        return per_row  # "output": o_proj per output row, its bias element-wise
    if param.dim() == 2 and lowered.endswith("weight") and "norm" not in lowered:
        return per_row  # "linear": any other Linear's weight per output row
    return None


def block_means(grad: torch.Tensor, blocks: list[int], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's mean of ``grad**2`` and each row's block index; ``dim`` 1 (a row-parallel slice): the rows' sums
    and widths added over the tp ranks."""
    sizes = torch.tensor(blocks, device=grad.device)
    rows = grad.reshape(len(grad) if grad.dim() else 1, -1)
    ids = torch.repeat_interleave(torch.arange(len(blocks), device=grad.device), sizes)
    row_sums, width = (rows * rows).sum(1), rows.shape[1]
    group, world, _ = _tp()
    if dim == 1 and world > 1:
        row_sums = row_sums.contiguous()
        dist.all_reduce(row_sums, group=group)
        width *= world
    sums = torch.zeros(len(blocks), dtype=grad.dtype, device=grad.device).index_add_(0, ids, row_sums)
    return sums / (sizes * width).to(grad.dtype), ids


class LevanterAdamMini(_RoleOptimizer):
    """Levanter's Adam-mini (module docstring). Each group carries ``blocks``: per parameter, its blocks (row counts)
    or None (``adamw``), and ``tp_dims``. State: ``step``, ``mu``, ``nu`` (one value per block for the mini
    parameters; under ZeRO element-wise on the flat partition)."""

    CLIPPED = "adamw"

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 max_grad_norm: float | None = 1.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0})
        self.max_grad_norm = max_grad_norm
        self.blocks_of = {id(p): b for g in self.param_groups for p, b in zip(g["params"], g["blocks"])}
        self.dims_of = {id(p): d for g in self.param_groups
                        for p, d in zip(g["params"], g.get("tp_dims") or [tp_dim(q) for q in g["params"]])}
        self.roles = {i: ("adamw" if b is None else "mini") for i, b in self.blocks_of.items()}

    @staticmethod
    def _mini_direction(grad: torch.Tensor, blocks: list[int], state: dict[str, Any], b1: float, b2: float,
                        eps: float, dim: int = -1) -> torch.Tensor:
        means, ids = block_means(grad, blocks, dim)
        if "mu" not in state:
            state["step"], state["mu"] = 0, torch.zeros_like(grad)
            state["nu"] = torch.zeros(len(blocks), dtype=grad.dtype, device=grad.device)
        state["step"] += 1
        t = state["step"]
        state["mu"].mul_(b1).add_(grad, alpha=1.0 - b1)
        state["nu"].mul_(b2).add_(means, alpha=1.0 - b2)
        denominator = (state["nu"] / (1.0 - b2**t)).sqrt().add_(eps)[ids]
        return (state["mu"] / (1.0 - b1**t)) / denominator.reshape(-1, *([1] * (grad.dim() - 1)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        adamw = [(param, dim) for group in self.param_groups
                 for param, blocks, dim in zip(group["params"], group["blocks"],
                                               group.get("tp_dims") or [tp_dim(p) for p in group["params"]])
                 if blocks is None and param.grad is not None and id(param) not in self.zero]
        clipped = clip_by_global_norm([param.grad for param, _ in adamw], self.max_grad_norm, [d for _, d in adamw])
        grads = {id(param): grad for (param, _), grad in zip(adamw, clipped)}
        for group in self.param_groups:
            b1, b2 = group["betas"]
            dims = group.get("tp_dims") or [tp_dim(p) for p in group["params"]]
            for param, blocks, dim in zip(group["params"], group["blocks"], dims):
                if param.grad is None:
                    continue
                state = self.state[param]
                if id(param) in self.zero:
                    update = self._zero_direction(param, state, b1, b2, group["eps"])
                elif blocks is None:
                    update = _adam_direction(grads[id(param)], state, b1, b2, group["eps"])
                else:
                    update = self._mini_direction(param.grad, blocks, state, b1, b2, group["eps"], dim)
                _decay_and_step(param, update, group["lr"], group["weight_decay"])
        return loss

    def _zero_direction(self, flat: torch.Tensor, state: dict[str, Any], b1: float, b2: float,
                        eps: float) -> torch.Tensor:
        """A ZeRO flat partition's update: the block means from the whole gradients (gathered over the
        data-parallel ranks), the ``adamw`` parameters' gradients clipped by the norm ``before_zero_step`` took."""
        zero, flat_grad = self.zero[id(flat)], flat.grad
        assert flat_grad is not None
        if self.max_grad_norm and self.zero_norm is None:
            raise RuntimeError("Adam-mini's clip under ZeRO needs the global norm taken before the step: build the "
                               "engine with megatron.engine.zero_attach.install_zero_pre_step")
        grads, seconds = [], []
        for whole, param in zip(zero.whole(flat_grad), zero.master.params):
            blocks = self.blocks_of.get(id(param))
            if blocks is None:
                (grad,) = clip_by_global_norm([whole], self.max_grad_norm, norm=self.zero_norm)
                grads.append(grad)
                seconds.append(grad * grad)
            else:
                means, ids = block_means(whole, blocks, self.dims_of.get(id(param), -1))
                grads.append(whole)
                seconds.append(means[ids].reshape(-1, *([1] * (whole.dim() - 1))).expand_as(whole))
        grad, second = zero.shard(grads, flat).view_as(flat), zero.shard(seconds, flat).view_as(flat)
        if "mu" not in state:
            state["step"], state["mu"], state["nu"] = 0, torch.zeros_like(flat), torch.zeros_like(flat)
        state["step"] += 1
        t = state["step"]
        state["mu"].mul_(b1).add_(grad, alpha=1.0 - b1)
        state["nu"].mul_(b2).add_(second, alpha=1.0 - b2)
        return (state["mu"] / (1.0 - b1**t)) / ((state["nu"] / (1.0 - b2**t)).sqrt() + eps)


def mini_groups(groups: list[dict[str, Any]], names: Mapping[torch.Tensor, str],
                layouts: Mapping[torch.Tensor, HeadLayout]) -> list[dict[str, Any]]:
    """The (decay, no decay) groups with each parameter's ``blocks`` and ``tp_dims`` (recorded from the model's
    parameters: DeepSpeed's fp32 copies lose the marks)."""
    return [{**group, "blocks": [mini_blocks(names[p], p, layouts.get(p)) for p in group["params"]],
             "tp_dims": [tp_dim(p) for p in group["params"]]} for group in groups]
