"""A dropless mixture-of-experts layer: router -> dispatch -> experts (one grouped matmul) -> combine.

It takes the place of the MLP in every ``moe_expert_interval``-th block (``GPTConfig.is_moe_layer``).
Every token reaches its ``moe_top_k`` experts: there is no capacity limit and nothing is dropped,
so the layer computes exactly ``y_t = sum_j w_tj * expert_{e_tj}(x_t)``, only batched.

Where the experts live (``megatron.mpu``): tensor-parallel rank ``t`` holds a contiguous
``E / tp`` of them, each whole (GPT-NeoX's layout), and with ``moe_expert_parallel_size = ep``
those are split again over ``ep`` data-parallel ranks that exchange tokens with all-to-all. Every
rank of a tensor-parallel group routes the same tokens (the router is replicated), computes the
experts it holds, and the partial outputs are summed over the group, exactly like the row-parallel
half of a dense MLP. The router sees its input without the tensor-parallel "copy" mapping, and the
combine weights go through it, so that the router's gradient (complete on every rank) is not summed
tp times while the experts' partial gradients are.

Auxiliary losses (load balancing, z-loss) are computed per layer and micro-batch and enter the
objective through :class:`_AuxLossGrad`: their gradient is injected during the backward pass, so
they need not travel to the last pipeline stage; the trainer sets ``aux_loss_scale`` to the scale
the engine applies to the main loss (1/gradient-accumulation steps, times the fp16 loss scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activations import get_activation
from megatron.model.config import GPTConfig, ModelConfigError
from megatron.mpu import experts as expert_parallel
from megatron.mpu.initialize_weights import (
    InitFn,
    initialize_param_,
    param_generator,
    set_tensor_model_parallel_attributes,
)
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.mpu.topology import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

SINKHORN_TOLERANCE = 1e-4
SINKHORN_MAX_ITERS = 1000
SINKHORN_CHECK_EVERY = 8
"""Iterations between convergence checks: each check reads a number from the device (a host sync on a
GPU, every MoE layer of every micro-batch), and a few iterations past convergence only move the
factors closer to their fixed point."""


# --- routing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    weights: torch.Tensor
    """[T, k] combine weight of each chosen expert."""
    indices: torch.Tensor
    """[T, k] int64 expert ids."""
    logits: torch.Tensor
    """[T, E] router logits (the auxiliary losses read them)."""


def topk_routing(logits: torch.Tensor, k: int, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest softmax probabilities and their experts; not renormalised (GPT-NeoX), or divided by
    their sum (``renormalize``: Mixtral)."""
    probs = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    weights, indices = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


def sinkhorn(
    logits: torch.Tensor, tol: float = SINKHORN_TOLERANCE, max_iters: int = SINKHORN_MAX_ITERS
) -> torch.Tensor:
    """Scale ``exp(logits)`` [T, E] by row and column factors until every token has mass 1/T and
    every expert 1/E (Sinkhorn-Knopp): a balanced soft assignment of tokens to experts.

    Runs in fp32; the largest logit is subtracted first (the factors absorb any constant), so
    exp cannot overflow.
    """
    cost = torch.exp(logits.float() - logits.float().max())
    tokens, num_experts = cost.shape
    eps = 1e-8
    col = torch.ones(num_experts, dtype=cost.dtype, device=cost.device)
    row = torch.ones(tokens, dtype=cost.dtype, device=cost.device)
    for i in range(1, max_iters + 1):
        row = (1.0 / tokens) / (cost @ col + eps)
        new_col = (1.0 / num_experts) / (row @ cost + eps)
        check = i % SINKHORN_CHECK_EVERY == 0
        converged = check and bool((new_col - col).abs().mean() <= tol)
        col = new_col
        if converged:
            break
    return row.unsqueeze(1) * cost * col.unsqueeze(0)


def sinkhorn_routing(logits: torch.Tensor, k: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX's Sinkhorn router: while training, experts come from the balanced assignment and
    weights from the plain scores (sigmoid for k = 1, softmax for k > 1); at evaluation both come
    from the scores (Sinkhorn needs the whole batch, autoregressive decoding has one token)."""
    if k == 1:
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    if not training:
        return scores.topk(k, dim=-1)
    with torch.no_grad():
        indices = sinkhorn(logits.detach()).topk(k, dim=-1).indices
    return scores.gather(1, indices), indices


class Router(nn.Module):
    """hidden [T, h] -> :class:`Routing`. Replicated on every tensor-parallel rank."""

    def __init__(self, config: GPTConfig, name: str) -> None:
        super().__init__()
        self.num_experts = config.moe_num_experts
        self.top_k = config.moe_top_k
        self.router_type = config.moe_router_type
        self.renormalize = config.moe_router_renormalize
        self.jitter_eps = config.moe_jitter_eps
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.arch.hidden, dtype=config.params_dtype))
        initialize_param_(self.weight, f"{name}.weight", config.seed, config.init_fn(),
                          (self.num_experts, config.arch.hidden))  # fmt: skip
        set_tensor_model_parallel_attributes(self.weight, False)

    def forward(self, tokens_th: torch.Tensor) -> Routing:
        if self.training and self.jitter_eps:
            # the default RNG stream: the same on every tp rank, so all of them route alike
            noise = torch.empty_like(tokens_th).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            tokens_th = tokens_th * noise
        logits_te = F.linear(tokens_th, self.weight)  # [T, E]
        if self.router_type == "topk":
            weights, indices = topk_routing(logits_te, self.top_k, self.renormalize)
        else:
            weights, indices = sinkhorn_routing(logits_te, self.top_k, self.training)
        return Routing(weights, indices, logits_te)


# --- auxiliary losses ------------------------------------------------------------------------------
def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] token-assignments per expert (a token routed to k experts counts k times)."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Switch/GShard balance loss ``E * sum_e f_e * P_e``: f_e the share of token-assignments that
    went to expert e (no gradient), P_e the mean router probability of e. 1.0 when routing is
    uniform; its gradient pushes probability away from over-used experts."""
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits.float() if fp32 else logits, dim=-1)
    share = expert_counts(indices, num_experts).to(probs.dtype) / (tokens * indices.shape[-1])
    return num_experts * (share * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-partition of the router logits (keeps them small)."""
    z = torch.logsumexp(logits.float() if fp32 else logits, dim=-1)
    return (z * z).mean()


def routing_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the entropy (nats) of the router's softmax distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum()


class _AuxLossGrad(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: also gives ``aux`` the gradient ``scale``, as if
    ``aux`` had been added to the (scaled) training loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


@dataclass
class RouterStats:
    """Sums since the trainer last read them (training forwards only)."""

    forwards: int = 0
    load_balancing: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    tokens: int = 0
    counts: torch.Tensor | None = None
    """[E] token-assignments per expert."""

    def add(self, lbl: torch.Tensor, z: torch.Tensor, entropy: torch.Tensor, tokens: int, counts: torch.Tensor) -> None:
        def acc(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
            value = value.detach().double()
            return value if total is None else total + value

        self.forwards += 1
        self.tokens += tokens
        self.load_balancing = acc(self.load_balancing, lbl)
        self.z_loss = acc(self.z_loss, z)
        self.entropy = acc(self.entropy, entropy)
        self.counts = acc(self.counts, counts)


# --- experts ---------------------------------------------------------------------------------------
def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: one dtype, 16-byte aligned row strides,
    and on CUDA bf16 on SM80 or newer (what ``torch.nn.functional.grouped_mm`` documents)."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 8):
        return False
    size = x.element_size()
    return (x.shape[-1] * size) % 16 == 0 and (w.shape[-1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward rejects the
    expanded gradient a ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def padded_grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_matmul` as one batched matmul: each expert's rows padded to the largest count
    (zeros), ``bmm``, padding dropped. More FLOPs than a grouped GEMM when routing is uneven, but
    one kernel, not a loop over experts."""
    experts, longest = counts.shape[0], int(counts.max()) if counts.numel() else 0
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
    first_row = counts.cumsum(0) - counts  # [E] where each expert's rows start in x
    rows = expert_of_row * longest + torch.arange(x.shape[0], device=x.device) - first_row[expert_of_row]
    padded = x.new_zeros(experts * longest, x.shape[1]).index_copy(0, rows, x)  # [E * longest, a]
    out = torch.bmm(padded.view(experts, longest, -1), w)  # [E, longest, b]
    return out.reshape(experts * longest, -1)[rows]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [n, a], grouped by expert (``counts[e]`` rows for expert e, in order), times
    their expert's ``w[e]`` [a, b] -> [n, b]. One grouped GEMM (``torch.nn.functional.grouped_mm``,
    measured faster than a loop over experts or a padded ``bmm`` on CPU too:
    tools/bench/moe_grouped_gemm.py) where torch supports the operands; otherwise a padded
    batched matmul on accelerators, and on CPU a loop over experts (faster there than padding)."""
    if _grouped_mm_fits(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), w, offs=offsets))
    if x.device.type != "cpu":
        return padded_grouped_matmul(x, w, counts)
    outputs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        outputs.append(x[start : start + count] @ w[e])
        start += count
    return torch.cat(outputs) if outputs else x.new_zeros((0, w.shape[-1]))


class GroupedExperts(nn.Module):
    """The experts one rank holds, stacked: ``w1`` [n, h, F] (F = 2 * ffn for gated activations,
    ``[gate; up]``), ``w2`` [n, ffn, h], optional biases ``w1_bias`` [n, F] and ``w2_bias`` [n, h].
    Expert ``g`` is drawn as a dense MLP would be, from ``(seed, "<name>.<g>.dense_h_to_4h.weight")``
    etc., so any split starts identical."""

    def __init__(self, config: GPTConfig, name: str, first_expert: int, num_local: int) -> None:
        super().__init__()
        self.activation = get_activation(config.mlp_activation)
        self.first_expert = first_expert
        """Global id of ``w1[0]``: this rank holds experts ``first_expert .. first_expert + n - 1``."""
        h, ffn = config.arch.hidden, config.expert_ffn_hidden_size  # GPT-NeoX's expert width rule
        width = 2 * ffn if self.activation.gated else ffn
        dtype = config.params_dtype
        self.w1 = nn.Parameter(torch.empty(num_local, h, width, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_local, ffn, h, dtype=dtype))
        # "*_bias": the optimizer's no-weight-decay rule goes by the name ending
        self.w1_bias = nn.Parameter(torch.zeros(num_local, width, dtype=dtype)) if config.use_bias_in_mlp else None
        self.w2_bias = nn.Parameter(torch.zeros(num_local, h, dtype=dtype)) if config.use_bias_in_mlp else None
        with torch.no_grad():
            for j in range(num_local):
                expert = f"{name}.{first_expert + j}"
                self.w1[j].copy_(_linear_weight(f"{expert}.dense_h_to_4h.weight", (width, h), config.seed,
                                                config.init_fn()).t())  # fmt: skip
                self.w2[j].copy_(_linear_weight(f"{expert}.dense_4h_to_h.weight", (h, ffn), config.seed,
                                                config.output_init_fn()).t())  # fmt: skip
        for param in self.parameters():
            # whole experts differ between tp ranks: count each once per rank in norms, and
            # concatenate the ranks' stacks along dim 0 when a checkpoint changes tp
            set_tensor_model_parallel_attributes(param, True, 0)
        expert_parallel.mark_expert_parallel(self.parameters())

    def forward(self, x_nh: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x_nh`` grouped by local expert, ``counts`` [n_local] rows each -> [n, h]."""
        hidden = grouped_matmul(x_nh, self.w1, counts)  # [n, F]
        if self.w1_bias is not None or self.w2_bias is not None:
            expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x_nh.device), counts,
                                                    output_size=x_nh.shape[0])  # fmt: skip
        if self.w1_bias is not None:
            hidden = hidden + self.w1_bias[expert_of_row]
        out = grouped_matmul(self.activation(hidden), self.w2, counts)  # [n, h]
        if self.w2_bias is not None:
            out = out + self.w2_bias[expert_of_row]
        return out


def _linear_weight(name: str, shape: tuple[int, int], seed: int, init_fn: InitFn) -> torch.Tensor:
    full = torch.empty(shape, dtype=torch.float32, device="cpu")  # drawn on the CPU wherever the model is built
    init_fn(full, param_generator(seed, name))
    return full


# --- dispatch and combine --------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """Where each of this rank's token-assignments goes: the rows of ``order`` (into the flattened
    [T * k] assignments) sorted by expert, restricted to the experts of this tp rank."""

    tokens: torch.Tensor
    """[n] the token of each assignment, grouped by expert."""
    slots: torch.Tensor
    """[n] index into the flattened [T * k] weights."""
    counts: torch.Tensor
    """[E / tp] assignments per expert of this tp rank's share."""


def plan_dispatch(indices: torch.Tensor, num_experts: int, first: int, count: int) -> Dispatch:
    """Sort the assignments by expert (stable: tokens keep their order within an expert) and keep
    those for experts ``first .. first + count - 1``."""
    k = indices.shape[-1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()
    start, end = bounds[first], bounds[first + count]
    slots = order[start:end]
    return Dispatch(tokens=slots // k, slots=slots, counts=counts[first : first + count])


def run_experts(x_nh: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """This tp rank's assignments (grouped by its experts) -> their expert outputs, exchanging them
    with the expert-parallel group when the experts are split over data-parallel ranks."""
    ep = expert_parallel.get_expert_parallel_world_size()
    if ep == 1:
        return experts(x_nh, counts)
    per_rank = counts.view(ep, -1)  # [ep, E_local]: what goes to each rank's experts
    incoming = expert_parallel.exchange_counts(per_rank)  # [ep, E_local]: what each rank sends us
    send, recv = per_rank.sum(1).tolist(), incoming.sum(1).tolist()
    received = expert_parallel.exchange_tokens(x_nh, send, recv)  # grouped by (source, expert)
    # regroup by (expert, source) for one grouped matmul (a stable sort by expert id), and back
    local = torch.arange(incoming.shape[1], device=x_nh.device).repeat(ep)  # blocks come (source, expert)
    expert_of_row = torch.repeat_interleave(local, incoming.reshape(-1), output_size=received.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    out_by_expert = experts(received[by_expert], incoming.sum(0))
    out = torch.empty_like(out_by_expert).index_copy(0, by_expert, out_by_expert)
    return expert_parallel.exchange_tokens(out, recv, send)


def moe_combine(x_th: torch.Tensor, weights_tk: torch.Tensor, plan: Dispatch, expert_out: torch.Tensor) -> torch.Tensor:
    """[T, h]: each token's expert outputs weighted and summed (zeros for tokens this rank's experts
    did not see)."""
    weighted = expert_out * weights_tk.reshape(-1)[plan.slots].unsqueeze(-1).to(expert_out.dtype)
    return torch.zeros_like(x_th).index_add(0, plan.tokens, weighted)


# --- the layer -------------------------------------------------------------------------------------
class MoELayer(nn.Module):
    """Drop-in for :class:`~megatron.model.mlp.MLP`: hidden [s, b, h] -> [s, b, h]."""

    def __init__(self, config: GPTConfig, name: str, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        tp = get_tensor_model_parallel_world_size()
        ep = expert_parallel.get_expert_parallel_world_size()
        self.num_experts = config.moe_num_experts
        if self.num_experts % (tp * ep) != 0:
            raise ModelConfigError(
                f"moe_num_experts={self.num_experts} is not divisible by model_parallel_size x "
                f"moe_expert_parallel_size = {tp} x {ep}"
            )
        self.experts_per_tp_rank = self.num_experts // tp
        self.first_expert = get_tensor_model_parallel_rank() * self.experts_per_tp_rank
        local = self.experts_per_tp_rank // ep
        first_local = self.first_expert + expert_parallel.get_expert_parallel_rank() * local
        self.router = Router(config, f"{name}.router")
        self.experts = GroupedExperts(config, f"{name}.experts", first_local, local)
        self.sequence_parallel = config.sequence_parallel and tp > 1
        self.lbl_in_fp32 = config.moe_lbl_in_fp32
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        self.aux_loss_scale = 1.0
        """Scale of the main loss's gradient (set by the trainer each step)."""
        self.stats = RouterStats()

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # route the whole sequence on every rank; the router's own gradient is complete on
            # each rank (split back), the experts' is partial (summed back)
            router_in = gather_from_sequence_parallel_region(x_sbh, grad_is_partial=False)
            expert_in = gather_from_sequence_parallel_region(x_sbh, grad_is_partial=True)
        else:
            router_in, expert_in = x_sbh, copy_to_tensor_model_parallel_region(x_sbh)
        s, b, h = expert_in.shape
        routing = self.router(router_in.reshape(s * b, h))
        plan = plan_dispatch(routing.indices, self.num_experts, self.first_expert, self.experts_per_tp_rank)
        tokens_th = expert_in.reshape(s * b, h)
        expert_out = run_experts(tokens_th[plan.tokens], plan.counts, self.experts)
        weights = copy_to_tensor_model_parallel_region(routing.weights)  # partial gradients, summed
        partial_sbh = moe_combine(tokens_th, weights, plan, expert_out).view(s, b, h)
        if self.sequence_parallel:
            out_sbh = reduce_scatter_to_sequence_parallel_region(partial_sbh)
        else:
            out_sbh = reduce_from_tensor_model_parallel_region(partial_sbh)
        return self._with_aux_losses(out_sbh, routing)

    def _with_aux_losses(self, out_sbh: torch.Tensor, routing: Routing) -> torch.Tensor:
        training = self.training and torch.is_grad_enabled()
        if not training:
            return out_sbh
        trains_on_aux = self.aux_loss_coeff > 0 or self.z_loss_coeff > 0
        with torch.set_grad_enabled(trains_on_aux):
            lbl = load_balancing_loss(routing.logits, routing.indices, self.lbl_in_fp32)
            z = router_z_loss(routing.logits, self.lbl_in_fp32)
        with torch.no_grad():
            self.stats.add(lbl, z, routing_entropy(routing.logits), routing.logits.shape[0],
                           expert_counts(routing.indices, self.num_experts))  # fmt: skip
        if not trains_on_aux:
            return out_sbh
        aux = self.aux_loss_coeff * lbl + self.z_loss_coeff * z
        return _AuxLossGrad.apply(out_sbh, aux, self.aux_loss_scale)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


__all__ = [
    "Dispatch",
    "GroupedExperts",
    "MoELayer",
    "Router",
    "RouterStats",
    "Routing",
    "grouped_matmul",
    "load_balancing_loss",
    "padded_grouped_matmul",
    "moe_combine",
    "moe_layers",
    "plan_dispatch",
    "router_z_loss",
    "routing_entropy",
    "run_experts",
    "sinkhorn",
    "sinkhorn_routing",
    "topk_routing",
]
