"""Levanter's Muon, Scion, MARS and Cautious as torch optimizers, their updates exactly as Levanter writes them.

Read from stanford-crfm/levanter at 9263f81e (``src/levanter/optim/{muon,scion,mars,cautious}.py``). Unlike ADOPT
(``megatron/engine/levanter_optim.py``) none of them is element-wise: Muon and Scion orthogonalise whole weight
matrices, MARS and the AdamW/signum halves of Muon and Scion clip by a global norm inside the optimizer, and
Cautious rescales by the fraction of a whole tensor its mask keeps. They run with data parallelism without ZeRO
(every rank steps the whole model on the all-reduced gradient) and under tensor parallelism, where a rank's slices
are completed here (:func:`whole`, :func:`global_norm`, Cautious's counts summed over the tp ranks). Under ZeRO
1-3 (each rank steps its partition of a flat buffer per group, one group per call) Muon and Scion gather each matrix
from the data-parallel ranks' partitions and take their clip's norm before DeepSpeed's step
(:class:`_RoleOptimizer`), MARS and Cautious step the partition as it is and add their sums (MARS's norm,
Cautious's mask counts) over the data-parallel ranks (:func:`zero_pieces`); pipeline stages (part of the layers) are refused before launch by name
(``megatron/engine/optimizer_checks.py``).

Every optimizer here ends as Levanter's chains do, ``add_decayed_weights(weight_decay, mask)`` then
``scale(-lr)``: ``p <- p - lr * (u + wd * p)`` (the decay is the group's ``weight_decay``; the mask is Deepy's
decay/no-decay groups, Levanter's default mask).

**Muon** (``muon.py:24-202``). Weight matrices of linear layers take Muon, everything else (embeddings, the output
layer, biases, norms: ``create_mask``, muon.py:91-111) takes AdamW at ``adam_lr``::

    muon:  buf = momentum * buf + g;  v = momentum * buf + g (nesterov) or buf
           u = NS5(v) * sqrt(max(1, out / in))       (use_kimi_scaling: * 0.2 * sqrt(max(out, in)))
    adamw: g = clip_by_global_norm(g, max_grad_norm)   (over the AdamW parameters only; Muon's are not clipped)
           u = optax.scale_by_adam(beta1, beta2, epsilon)

``NS5`` (``zeropower_via_newtonschulz5``, muon.py:171-202): ``X /= ||X||_F + muon_epsilon``, transposed when it
has more rows than columns, ``backend_steps`` times ``A = X X^T; X = a X + (b A + c A A) X`` with
``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in the parameter's dtype (fp32 here). Levanter's Muon asserts its
linear layers are stored out-first unless ``use_kimi_scaling`` (muon.py:104-106), which its GPT-2 (``out_first=False``,
gpt2.py:142-176) is not; torch stores every weight out-first, so the ``out / in`` scale is the one that assertion
asks for. Deepy's fused ``query_key_value`` holds Levanter GPT-2's fused ``c_attn`` rows in another order, and the
orthogonalisation commutes with a row permutation, so it is the same update; Levanter's Llama keeps q, k, v (and
gate/up) as separate matrices, which Deepy orthogonalises as the one fused matrix it stores.

``torch.optim.Muon`` (torch 2.13, ``torch/optim/_muon.py``) is not used: its Newton-Schulz runs in bfloat16
(``grad.bfloat16()``), its momentum is damped (``buf.lerp_(grad, 1 - momentum)``), it divides by
``max(||X||, eps)`` rather than ``||X|| + eps``, and it has no AdamW half; in fp32 it differs from Levanter's by
far more than 1e-6.

**Scion** (``scion.py:22-178``): linear-layer matrices take Scion at ``lr``, the rest signum at
``lr * scion_to_signum_lr``::

    scion:  buf = momentum * buf + (1 - momentum) * g;  u = NS(buf, backend_steps, scion_epsilon) * sqrt(max(1, out/in))
    signum: g = clip_by_global_norm(g, max_grad_norm) (signum parameters only)
            buf = beta1 * buf + (1 - beta1) * g;  u = sign(buf)

**MARS** (``scale_by_mars``, ``mars.py:65-127``), ``og`` the previous step's gradient (zeros at first)::

    c  = g + gamma * b1 / (1 - b1) * (g - og)
    c *= min(1, max_grad_norm / (||c||_global + 1e-6))           (when max_grad_norm)
    mu = b1 mu + (1 - b1) c;  nu = b2 nu + (1 - b2) c**2;  t += 1
    u  = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t)) + eps)

**Cautious** (``scale_by_cautious``, ``cautious.py:77-130``), after Levanter's ``clip_by_global_norm``
(DeepSpeed's ``gradient_clipping`` here, as for Adam)::

    u    = Adam's bias-corrected update (b1, b2, eps)
    mask = (g * u > 0)
    u    = u * mask / (mean(mask) + eps)

``mean(mask)`` is over a whole leaf of Levanter's parameter tree, and Levanter stacks the blocks of a model into one
leaf per weight (``Stacked``, gpt2.py:253-259; Llama's ``scan_layers: true``): the mean runs over that weight in
every layer (and every expert). Deepy holds one tensor per layer, so a parameter's *stack* (its name with the
layer and expert indices taken out, ``stack_name``) groups the tensors whose masks are averaged together.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.deepspeed_internals import fp32_master_slices
from megatron.deepspeed_internals import ZeroMaster
from megatron.engine.levanter_optim import closure_loss
from megatron.engine.whole_parameters import ZeroWhole, tp_own, tp_whole, zero_wholes

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Levanter's quintic Newton-Schulz coefficients (muon.py:176, scion.py:164)."""

_INDEX = re.compile(r"(^|\.)\d+(?=\.)")


def stack_name(name: str) -> str:
    """The parameter's leaf in Levanter's stacked tree: its name with every layer/expert index taken out
    (``layers.3.attention.dense.weight`` and a pipeline's ``5.attention.dense.weight`` -> ``*.attention...``)."""
    return _INDEX.sub(r"\1*", name)


def is_linear_matrix(name: str, param: torch.Tensor) -> bool:
    """Levanter's Muon/Scion mask (muon.py:98-109): the weight of a linear layer, not an embedding (``Embedding``)
    nor the output layer (``lm_head``); Deepy's value head is a head too."""
    shape = getattr(param, "ds_shape", param.shape)  # a ZeRO-3 placeholder's real shape
    lowered = name.lower()
    heads = ("embeddings", "output_layer", "value_head", "lm_head")
    return len(shape) == 2 and lowered.endswith("weight") and "norm" not in lowered and not any(
        head in lowered for head in heads)


def newton_schulz5(x: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Levanter's ``zeropower_via_newtonschulz5`` (muon.py:171-202; scion.py:159-178 is the same), in x's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = x / (torch.linalg.norm(x) + eps)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transpose else x


# --- tensor parallelism: a rank holds a slice of a split tensor (``tp_dims``: its split dimension, -1 if whole) ---
def _tp() -> tuple[Any, int, int]:
    """The tensor-parallel group, its size and this rank's place in it (size 1 without model-parallel groups)."""
    if not mpu.model_parallel_is_initialized() or mpu.get_tensor_model_parallel_world_size() == 1:
        return None, 1, 0
    return (mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_rank())


def tp_dim(param: torch.Tensor) -> int:
    """The dimension a tensor-parallel parameter is split along (``set_tensor_model_parallel_attributes``), -1 for a
    replicated one."""
    return int(getattr(param, "partition_dim", -1)) if getattr(param, "tensor_model_parallel", False) else -1


def whole(shard: torch.Tensor, dim: int) -> torch.Tensor:
    """The tensor from every tp rank's slice, in rank order along ``dim``. For a fused tensor (``[q; k; v]``, each
    section split) that is the whole tensor with its rows or columns permuted, which is all Newton-Schulz needs:
    ``NS(P X Q) = P NS(X) Q`` and the Frobenius norm is unchanged."""
    group, world, _ = _tp()
    if dim < 0 or world == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim)


def own(full: torch.Tensor, dim: int) -> torch.Tensor:
    """This tp rank's slice of a tensor :func:`whole` assembled."""
    _, world, rank = _tp()
    return full if dim < 0 or world == 1 else full.chunk(world, dim)[rank]


def _tp_sum(split: torch.Tensor) -> torch.Tensor:
    """Sums over the tp ranks of what their split tensors contribute (the replicated ones count once, not here)."""
    group, world, _ = _tp()
    if world > 1:
        dist.all_reduce(split, group=group)
    return split


def global_norm(tensors: Iterable[torch.Tensor], dims: Iterable[int] | None = None) -> torch.Tensor:
    """``optax.global_norm``: the norm of all the tensors as one vector, split tensors summed over the tp ranks."""
    tensors = list(tensors)
    dims = list(dims) if dims is not None else [-1] * len(tensors)
    replicated, split = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for t, dim in zip(tensors, dims):
        if dim < 0:
            replicated += t.double().pow(2).sum()
        else:
            split += t.double().pow(2).sum()
    return (replicated + _tp_sum(split)).sqrt().float()


def clip_by_global_norm(grads: list[torch.Tensor], max_norm: float | None,
                        dims: list[int] | None = None, norm: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``optax.clip_by_global_norm``: unchanged below ``max_norm``, else ``g / norm * max_norm`` (no epsilon).
    ``norm``: the global norm when it was taken before (under ZeRO, over groups this call does not see)."""
    if not max_norm:
        return grads
    norm = global_norm(grads, dims) if norm is None else norm
    if bool(norm < max_norm):
        return grads
    return [g / norm.to(g.dtype) * max_norm for g in grads]


def _decay_and_step(param: torch.Tensor, update: torch.Tensor, lr: float, decay: float) -> None:
    """``add_decayed_weights`` then ``scale(-lr)``: ``p <- p - lr * (u + wd * p)``."""
    param.sub_(lr * (update + decay * param))


def _adam_direction(grad: torch.Tensor, state: dict[str, Any], b1: float, b2: float, eps: float) -> torch.Tensor:
    """``optax.scale_by_adam`` (eps_root 0): bias-corrected moments, ``mu_hat / (sqrt(nu_hat) + eps)``."""
    if "mu" not in state:
        state["step"], state["mu"], state["nu"] = 0, torch.zeros_like(grad), torch.zeros_like(grad)
    state["step"] += 1
    t = state["step"]
    state["mu"].mul_(b1).add_(grad, alpha=1.0 - b1)
    state["nu"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    return (state["mu"] / (1.0 - b1**t)) / ((state["nu"] / (1.0 - b2**t)).sqrt() + eps)


def _with_dims(group: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """The group's parameters and their tp split dimensions (``tp_dims``, recorded from the model's parameters when
    the groups were made: DeepSpeed's mixed-precision wrapper hands the optimizer fp32 copies without the marks)."""
    dims = group.get("tp_dims") or [tp_dim(p) for p in group["params"]]
    return list(zip(group["params"], dims))


class _RoleOptimizer(torch.optim.Optimizer):
    """Groups carry a ``role`` (which half of Levanter's ``multi_transform`` steps them), ``stacks`` (each
    parameter's :func:`stack_name`) and ``tp_dims``; ``lr_scale`` (read by the schedule) sets a half's own rate.

    Under ZeRO (stages 1-3) DeepSpeed hands the optimizer one flat fp32 partition per group and steps the groups one
    at a time: :meth:`attach_zero` (called by ``whole_parameters.attach_whole_parameters``) says where the model's
    parameters lie in each partition, so the matrices are gathered whole over the data-parallel ranks
    (:class:`ZeroWhole`) and every rank keeps its partition of the update; :meth:`before_zero_step` takes the
    clipped half's global norm over every group before DeepSpeed steps them (``megatron/engine/zero_attach.py``)."""

    CLIPPED = ""
    """The role whose gradients are clipped by their own global norm (the AdamW/signum half)."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        # the model's parameters' roles, before DeepSpeed swaps in its flat partitions (ZeRO's parameters are these)
        self.roles = {id(p): g.get("role") for g in self.param_groups for p in g["params"]}
        self.sections = {id(p): getattr(p, "partition_sections", None) for g in self.param_groups
                         for p in g["params"]}
        self.zero: dict[int, ZeroWhole] = {}
        self.zero_norm: torch.Tensor | None = None

    def attach_zero(self, masters: list[ZeroMaster]) -> None:
        """Step ZeRO's flat partitions (``deepspeed_internals.zero_masters``) through the whole matrices in them."""
        self.zero = zero_wholes(masters)

    def before_zero_step(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The clipped half's global norm from this rank's part of every reduced gradient (summed over the
        data-parallel ranks, then the tp-split parameters' over the tp ranks), for this step's groups."""
        parts = [(g, tp_dim(p)) for p, g in pending if self.roles.get(id(p)) == self.CLIPPED]
        replicated = torch.zeros((), dtype=torch.float64)
        split = torch.zeros((), dtype=torch.float64)
        for grad, dim in parts:
            if dim < 0:
                replicated += grad.double().pow(2).sum()
            else:
                split += grad.double().pow(2).sum()
        sums = torch.stack([replicated, split])
        group = next(iter(self.zero.values())).master.group if self.zero else None
        dist.all_reduce(sums, group=group)
        self.zero_norm = (sums[0] + _tp_sum(sums[1])).sqrt().float()

    def _clip(self, todo: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], int]],
              max_norm: float | None) -> list[torch.Tensor]:
        grads = [g for _, g, _, _ in todo]
        if not any(id(p) in self.zero for p, *_ in todo):
            return clip_by_global_norm(grads, max_norm, [d for *_, d in todo])
        if max_norm and self.zero_norm is None:
            raise RuntimeError("a ZeRO partition's clip needs the global norm taken before the step: build the engine "
                               "with megatron.engine.zero_attach.install_zero_pre_step")
        return clip_by_global_norm(grads, max_norm, norm=self.zero_norm)

    def _grads_of(self, role: str) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], int]]:
        return [(p, p.grad, g, -1 if id(p) in self.zero else dim)
                for g in self.param_groups if g.get("role") == role for p, dim in _with_dims(g)
                if p.grad is not None]

    def _orthogonalised(self, param: torch.Tensor, direction: torch.Tensor, dim: int,
                        update: Callable[[torch.Tensor], torch.Tensor], group: dict[str, Any]) -> torch.Tensor:
        """``update`` of each whole matrix (gathered over the tp ranks, and over the data-parallel ranks when
        ``param`` is a ZeRO partition), as this rank's part of ``param``. With the group's
        ``orthogonalise_sections`` a fused matrix (``[q; k; v]``, ``[gate; up]``: the model's ``partition_sections``)
        is put together in the model's row order and each section updated apart, as Levanter's Llama-family models
        hold them (separate ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``)."""
        apart = bool(group.get("orthogonalise_sections"))
        zero = self.zero.get(id(param))
        if zero is None:
            sections = self.sections.get(id(param)) or _group_sections(group, param)
            return _matrix_update(direction, dim, sections if apart else None, update)
        return zero.shard([_matrix_update(m, split[0] if split is not None else -1,
                                          getattr(p, "partition_sections", None) if apart else None, update)
                           for m, split, p in zip(zero.whole(direction), zero.splits, zero.master.params)],
                          param).view_as(param)


def _group_sections(group: dict[str, Any], param: torch.Tensor) -> list[int] | None:
    """The fused sections ``split_groups`` recorded for ``param`` (a copy DeepSpeed's fp16 wrapper made of it has
    the same place in the group, not the marks)."""
    for p, sections in zip(group["params"], group.get("sections") or []):
        if p is param:
            return sections
    return None


def _matrix_update(local: torch.Tensor, dim: int, sections: list[int] | None,
                   update: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``update`` of the whole matrix this tp rank holds ``local`` of (split along ``dim``, -1: whole), as this
    rank's part; with ``sections`` (full sizes along dim 0) each section's update apart. Without sections the tp
    ranks' parts are joined in rank order (a row permutation of a fused matrix, which Newton-Schulz commutes with);
    with them in the model's own order (``whole_parameters.tp_whole``), so the sections are whole rows."""
    if not sections or len(sections) == 1:
        return own(update(whole(local, dim)), dim)
    split = (dim, list(sections)) if dim >= 0 and _tp()[1] > 1 else None
    full = tp_whole(local, split)
    return tp_own(torch.cat([update(part) for part in full.split(list(sections), dim=0)]), split)


def split_groups(groups: list[dict[str, Any]], names: Mapping[torch.Tensor, str], lr: float,
                 role: Callable[[str, torch.Tensor], str] = lambda name, param: "all",
                 scales: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Each (decay, no decay) group split by role, named ``<group>.<role>``, with the role's ``lr_scale``
    multiplied into the group's own (muP's regrouping sets one), its rate until the schedule sets it (``lr``, the
    peak, times the scale) and the parameters' stacks."""
    scales = scales or {}
    out = []
    for group in groups:
        by_role: dict[str, list[torch.Tensor]] = {}
        for param in group["params"]:
            by_role.setdefault(role(names[param], param), []).append(param)
        for kind, params in by_role.items():
            scale = group.get("lr_scale", 1.0) * scales.get(kind, 1.0)
            out.append({**group, "params": params, "name": f"{group.get('name', 'group')}.{kind}", "role": kind,
                        "lr_scale": scale, "lr": lr * scale, "stacks": [stack_name(names[p]) for p in params],
                        "tp_dims": [tp_dim(p) for p in params],
                        "sections": [getattr(p, "partition_sections", None) for p in params]})
    return out


class LevanterMuon(_RoleOptimizer):
    """Levanter's Muon (module docstring); groups of role ``muon`` or ``adamw``."""

    CLIPPED = "adamw"

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.95,
                 nesterov: bool = True, backend_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, muon_epsilon: float = 1e-8, max_grad_norm: float | None = 1.0,
                 use_kimi_scaling: bool = False, weight_decay: float = 0.0,
                 orthogonalise_sections: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "backend_steps": backend_steps,
                                  "betas": tuple(betas), "eps": eps, "muon_epsilon": muon_epsilon,
                                  "use_kimi_scaling": use_kimi_scaling, "weight_decay": weight_decay,
                                  "role": "muon", "orthogonalise_sections": orthogonalise_sections})
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        adam = self._grads_of("adamw")
        clipped = self._clip(adam, self.max_grad_norm)
        for (param, _, group, _), grad in zip(adam, clipped):
            b1, b2 = group["betas"]
            _decay_and_step(param, _adam_direction(grad, self.state[param], b1, b2, group["eps"]), group["lr"],
                            group["weight_decay"])
        for param, grad, group, dim in self._grads_of("muon"):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            mom = group["momentum"]
            buf = state["momentum_buffer"].mul_(mom).add_(grad)

            def scaled(direction: torch.Tensor, group: dict[str, Any] = group) -> torch.Tensor:
                rows, cols = direction.shape
                scale = (0.2 * math.sqrt(max(rows, cols)) if group["use_kimi_scaling"]
                         else math.sqrt(max(1.0, rows / cols)))
                return newton_schulz5(direction, group["backend_steps"], group["muon_epsilon"]) * scale

            update = self._orthogonalised(param, mom * buf + grad if group["nesterov"] else buf, dim, scaled, group)
            _decay_and_step(param, update, group["lr"], group["weight_decay"])
        return loss


class LevanterScion(_RoleOptimizer):
    """Levanter's Scion (module docstring); groups of role ``scion`` or ``signum``."""

    CLIPPED = "signum"

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.95, backend_steps: int = 10,
                 beta1: float = 0.9, scion_epsilon: float = 1e-8, max_grad_norm: float | None = 1.0,
                 weight_decay: float = 0.0, orthogonalise_sections: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "backend_steps": backend_steps, "beta1": beta1,
                                  "scion_epsilon": scion_epsilon, "weight_decay": weight_decay, "role": "scion",
                                  "orthogonalise_sections": orthogonalise_sections})
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        signum = self._grads_of("signum")
        clipped = self._clip(signum, self.max_grad_norm)
        for (param, _, group, _), grad in zip(signum, clipped):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            b1 = group["beta1"]
            buf = state["momentum_buffer"].mul_(b1).add_(grad, alpha=1.0 - b1)
            _decay_and_step(param, torch.sign(buf), group["lr"], group["weight_decay"])
        for param, grad, group, dim in self._grads_of("scion"):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            mom = group["momentum"]
            buf = state["momentum_buffer"].mul_(mom).add_(grad, alpha=1.0 - mom)

            def scaled(direction: torch.Tensor, group: dict[str, Any] = group) -> torch.Tensor:
                rows, cols = direction.shape
                return (newton_schulz5(direction, group["backend_steps"], group["scion_epsilon"])
                        * math.sqrt(max(1.0, rows / cols)))

            _decay_and_step(param, self._orthogonalised(param, buf, dim, scaled, group), group["lr"],
                            group["weight_decay"])
        return loss


# --- ZeRO (stages 1-3): the optimizer steps this rank's partition of a flat fp32 buffer per group -------------------
Piece = tuple[torch.Tensor, tuple[int, int] | None, int]
"""What one step sees of one parameter: the tensor the optimizer steps (the parameter, DeepSpeed's fp32 copy of it, or
the flat partition holding a part of it), where the parameter's elements lie in it (offset, count; None: all of it),
and the parameter's index in its group (its ``stacks``, ``tp_dims`` and ``decays`` entries)."""


def _segment(tensor: torch.Tensor, where: tuple[int, int] | None) -> torch.Tensor:
    return tensor if where is None else tensor.view(-1).narrow(0, where[0], where[1])


def zero_pieces(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[Any, list[Piece]] | None:
    """Where the model's ``params`` (the group's, as built) lie in ``flat``, the tensor a ZeRO optimizer steps for
    them: the data-parallel group whose ranks' partitions make up the buffer, and one piece per parameter with
    elements in this rank's partition; None when ``flat`` is not a ZeRO partition (no ZeRO: the group holds whole
    tensors). DeepSpeed 0.19.8's layout as ``deepspeed_internals.fp32_master_slices`` reads it: ZeRO-1/2 a
    fragment of the parameter (its ``_hp_mapping``), ZeRO-3 ``ceil(n / dp)`` elements of every parameter, the last
    rank's padded (only the parameter's own elements are counted)."""
    slices = fp32_master_slices(None, list(params))
    if not slices or slices[0] is None or slices[0][2] is None:
        return None
    base, first = flat.untyped_storage().data_ptr(), flat.storage_offset()
    pieces: list[Piece] = []
    for index, (param, where) in enumerate(zip(params, slices)):
        assert where is not None
        view, start, _ = where
        if view.numel() == 0:
            continue  # ZeRO-1/2: wholly in other ranks' partitions
        if view.untyped_storage().data_ptr() != base:
            raise RuntimeError("Levanter's MARS and Cautious need each parameter group in one ZeRO-3 sub-group (their "
                               "global norm and mask counts span the group); raise zero_optimization.sub_group_size "
                               "above this rank's partition of the model")
        count = max(0, min(view.numel(), int(getattr(param, "ds_numel", param.numel())) - start))
        pieces.append((flat, (view.storage_offset() - first, count), index))
    return slices[0][2], pieces


class _PieceOptimizer(torch.optim.Optimizer):
    """An optimizer whose groups' tensors may be ZeRO partitions: it keeps the model's parameters of each group
    (``model_params`` names the group's list) to find them in the partitions (:func:`zero_pieces`)."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.model_params = [list(group["params"]) for group in self.param_groups]
        for index, group in enumerate(self.param_groups):
            group["model_params"] = index

    def _pieces(self) -> tuple[list[tuple[dict[str, Any], torch.Tensor]], list[tuple[dict[str, Any], Piece]], Any]:
        """The (group, tensor) pairs this step updates, every parameter's piece of them, and the data-parallel group
        when they are ZeRO partitions (the sums then add every rank's pieces), else None."""
        tensors: list[tuple[dict[str, Any], torch.Tensor]] = []
        pieces: list[tuple[dict[str, Any], Piece]] = []
        dp = None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            layout = None
            if len(params) == 1 and "model_params" in group:
                layout = zero_pieces(params[0], self.model_params[group["model_params"]])
            if layout is None:
                pieces += [(group, (p, None, i)) for i, p in enumerate(group["params"]) if p.grad is not None]
            else:
                dp = layout[0]
                pieces += [(group, piece) for piece in layout[1]]
            tensors += [(group, p) for p in params]
        return tensors, pieces, dp


def _sums(rows: torch.Tensor, split: list[bool], dp: Any) -> torch.Tensor:
    """Per-row sums over the ranks: every column over the data-parallel ranks (ZeRO partitions), then the rows of
    tensor-parallel-split parameters over the tp ranks (the replicated ones count once)."""
    if dp is not None:
        dist.all_reduce(rows, group=dp)
    mask = torch.tensor(split, dtype=torch.bool)
    if bool(mask.any()):
        rows[mask] = _tp_sum(rows[mask].contiguous())
    return rows


class LevanterMars(_PieceOptimizer):
    """Levanter's ``scale_by_mars`` (module docstring); the global norm is over every parameter stepped. A group's
    ``decays`` (``merge_groups``) give each parameter its own weight decay, so that one group holds them all: ZeRO
    steps its groups one at a time, and the norm needs every gradient of the step."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.95, 0.99),
                 gamma: float = 0.025, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "gamma": gamma, "eps": eps,
                                  "weight_decay": weight_decay})
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        tensors, pieces, dp = self._pieces()
        if dp is not None and len(self.model_params) > 1:
            raise RuntimeError("Levanter's MARS under ZeRO needs one parameter group (its norm spans every gradient, "
                               "and ZeRO steps the groups one at a time); muP's per-width rates make several")
        corrected = {}
        for group, param in tensors:
            state = self.state[param]
            if not state:
                state["step"] = 0
                for key in ("mu", "nu", "mog"):
                    state[key] = torch.zeros_like(param)
            b1 = group["betas"][0]
            grad = param.grad
            assert grad is not None
            corrected[id(param)] = grad + (group["gamma"] * b1 / (1.0 - b1)) * (grad - state["mog"])
            state["mog"] = grad.detach().clone()
        if self.max_grad_norm:
            sums = torch.zeros(2, dtype=torch.float64)  # replicated, tp-split
            for group, (tensor, where, index) in pieces:
                dims = group.get("tp_dims") or [tp_dim(p) for p in self.model_params[group.get("model_params", 0)]]
                sums[int(dims[index] >= 0)] += _segment(corrected[id(tensor)], where).double().pow(2).sum()
            sums = _sums(sums.view(2, 1), [False, True], dp)
            scale = torch.clamp(self.max_grad_norm / (sums.sum().sqrt().float() + 1e-6), max=1.0)
            corrected = {key: c * scale.to(c.dtype) for key, c in corrected.items()}
        updates = {}
        for group, param in tensors:
            state, c = self.state[param], corrected[id(param)]
            b1, b2 = group["betas"]
            state["step"] += 1
            t = state["step"]
            state["mu"].mul_(b1).add_(c, alpha=1.0 - b1)
            state["nu"].mul_(b2).addcmul_(c, c, value=1.0 - b2)
            updates[id(param)] = (state["mu"] / (1.0 - b1**t)) / ((state["nu"] / (1.0 - b2**t)).sqrt() + group["eps"])
        for group, (tensor, where, index) in pieces:
            decay = group["decays"][index] if "decays" in group else group["weight_decay"]
            _decay_and_step(_segment(tensor, where), _segment(updates[id(tensor)], where), group["lr"], decay)
        return loss


def merge_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``split_groups``' groups with the same rate in one (``decays``: each parameter's own weight decay), as
    Levanter's one chain steps every leaf; groups of different rates (muP's) stay apart."""
    merged: dict[float, dict[str, Any]] = {}
    for group in groups:
        decays = [group["weight_decay"]] * len(group["params"])
        into = merged.get(group.get("lr_scale", 1.0))
        if into is None:
            merged[group.get("lr_scale", 1.0)] = {**group, "params": list(group["params"]), "decays": decays,
                                                  "stacks": list(group.get("stacks", [])),
                                                  "tp_dims": list(group.get("tp_dims", []))}
            continue
        into["params"] += group["params"]
        into["decays"] += decays
        into["stacks"] += group.get("stacks", [])
        into["tp_dims"] += group.get("tp_dims", [])
        into["name"] = "all"
    return list(merged.values())


class LevanterCautious(_PieceOptimizer):
    """Levanter's ``scale_by_cautious`` (module docstring); the mask's mean is over each parameter's stack (a stack
    is within one group: the same weight in every layer decays alike)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.95, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        tensors, pieces, dp = self._pieces()
        updates, masks = {}, {}
        for group, param in tensors:
            b1, b2 = group["betas"]
            grad = param.grad
            assert grad is not None
            updates[id(param)] = _adam_direction(grad, self.state[param], b1, b2, group["eps"])
            masks[id(param)] = (grad * updates[id(param)]) > 0
        # stack -> (mask entries true, entries) of this rank's pieces; the same stacks, in order, on every rank
        is_split = {stack: dim >= 0 for group, _ in tensors
                    for stack, dim in zip(self._stacks(group), group.get("tp_dims") or [-1] * len(self._stacks(group)))}
        names = sorted(is_split)
        rows = torch.zeros(len(names), 2, dtype=torch.float64)
        place = {name: i for i, name in enumerate(names)}
        for group, (tensor, where, index) in pieces:
            stack = self._stacks(group)[index]
            mask = _segment(masks[id(tensor)], where)
            rows[place[stack]] += torch.tensor([float(mask.sum()), float(mask.numel())], dtype=torch.float64)
        if names:
            rows = _sums(rows, [is_split[n] for n in names], dp)
        for group, (tensor, where, index) in pieces:
            true, total = rows[place[self._stacks(group)[index]]].tolist()
            cautious = _segment(updates[id(tensor)], where) * _segment(masks[id(tensor)], where)
            _decay_and_step(_segment(tensor, where), cautious / (true / total + group["eps"]), group["lr"],
                            group["weight_decay"])
        return loss

    def _stacks(self, group: dict[str, Any]) -> list[str]:
        return group.get("stacks") or [str(id(p)) for p in self.model_params[group.get("model_params", 0)]]
