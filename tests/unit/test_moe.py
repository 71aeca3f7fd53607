"""The MoE layer on one process: routers against direct computations, dropless dispatch/combine
against a per-token loop, the auxiliary losses against hand computations, and every moe_* key
changing what it should."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.model import GPTConfig, GPTModel, flops_per_token, lm_loss, num_parameters
from megatron.model.activations import get_activation
from megatron.model.mlp import MLP
from megatron.model.moe import (
    MoELayer,
    grouped_matmul,
    load_balancing_loss,
    padded_grouped_matmul,
    plan_dispatch,
    router_z_loss,
    sinkhorn,
    sinkhorn_routing,
    topk_routing,
)

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=7)
MOE = dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer(**overrides: object) -> MoELayer:
    cfg = GPTConfig(**{**BASE, **MOE, **overrides})
    return MoELayer(cfg, "layers.0.mlp", 0)


# --- routers ---------------------------------------------------------------------------------------
def test_topk_router_picks_the_highest_softmax_probabilities() -> None:
    logits = torch.randn(16, 6, generator=gen(0))
    weights, indices = topk_routing(logits, 2)
    for t in range(16):
        probs = [math.exp(v) for v in logits[t].tolist()]
        probs = [p / sum(probs) for p in probs]
        ranked = sorted(range(6), key=lambda e: -probs[e])[:2]
        assert indices[t].tolist() == ranked
        assert weights[t].tolist() == pytest.approx([probs[e] for e in ranked], rel=1e-5)


def test_renormalised_topk_router_is_mixtrals() -> None:
    """moe_router_renormalize: HF's MixtralSparseMoeBlock.forward (softmax in fp32, topk, divide by the sum),
    re-derived here; the layer's output changes with it."""
    logits = torch.randn(16, 6, generator=gen(1))
    weights, indices = topk_routing(logits, 2, renormalize=True)
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(indices, top.indices)
    assert torch.allclose(weights.double(), top.values / top.values.sum(-1, keepdim=True), atol=1e-6)
    x = torch.randn(8, 2, 32, generator=gen(2))
    assert not torch.allclose(layer()(x), layer(moe_router_renormalize=True)(x))


def direct_sinkhorn(logits: torch.Tensor, iters: int = 5000) -> torch.Tensor:
    """Alternately rescale rows to 1/T and columns to 1/E, in float64, far past convergence."""
    m = torch.exp(logits.double())
    tokens, experts = m.shape
    for _ in range(iters):
        m = m / m.sum(1, keepdim=True) / tokens
        m = m / m.sum(0, keepdim=True) / experts
    return m


def test_sinkhorn_balances_and_matches_a_direct_computation() -> None:
    logits = torch.randn(32, 4, generator=gen(1)) * 2 + torch.tensor([3.0, 0.0, 0.0, -2.0])  # skewed
    plan = sinkhorn(logits)
    assert plan.sum(1).tolist() == pytest.approx([1 / 32] * 32, rel=2e-3)
    assert plan.sum(0).tolist() == pytest.approx([1 / 4] * 4, rel=2e-3)
    want = direct_sinkhorn(logits)
    torch.testing.assert_close(plan.double(), want, rtol=5e-3, atol=1e-6)
    assert torch.equal(plan.topk(1).indices, want.topk(1).indices)
    # skewed logits: plain top-1 piles onto expert 0, the balanced assignment spreads tokens out
    plain = torch.bincount(logits.argmax(1), minlength=4)
    balanced = torch.bincount(plan.argmax(1), minlength=4)
    assert plain.max() > balanced.max()


def test_sinkhorn_routing_weights_follow_gpt_neox() -> None:
    logits = torch.randn(12, 4, generator=gen(2))
    w, idx = sinkhorn_routing(logits, 1, training=True)
    assert torch.equal(idx, sinkhorn(logits).topk(1).indices)
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, idx))  # k = 1: sigmoid
    w, idx = sinkhorn_routing(logits, 2, training=True)
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, idx))  # k > 1: softmax
    w, idx = sinkhorn_routing(logits, 2, training=False)  # evaluation: plain top-k of the scores
    assert torch.equal(idx, torch.softmax(logits, -1).topk(2).indices)


# --- dispatch and combine --------------------------------------------------------------------------
def expert_mlp(moe: MoELayer, e: int, x: torch.Tensor, activation: str) -> torch.Tensor:
    """Expert ``e`` on one token, in float64: the reference carries no rounding of its own."""
    ex = moe.experts
    x = x.double()
    hidden = x @ ex.w1[e].double() + (ex.w1_bias[e].double() if ex.w1_bias is not None else 0.0)
    out = get_activation(activation)(hidden) @ ex.w2[e].double()
    return out + (ex.w2_bias[e].double() if ex.w2_bias is not None else 0.0)


@pytest.mark.parametrize("activation,bias,k", [("gelu", True, 2), ("swiglu", False, 1), ("gelu", True, 4)])
def test_dropless_layer_equals_a_per_token_loop(activation: str, bias: bool, k: int) -> None:
    moe = layer(activation=activation, use_bias_in_mlp=bias, moe_top_k=k)
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.normal_(0, 0.3, generator=gen(3))  # non-zero biases too
    x = torch.randn(8, 3, 32, generator=gen(4))
    out = moe(x)
    routing = moe.router(x.reshape(-1, 32))
    tokens = x.reshape(-1, 32)
    want = torch.stack([
        sum(routing.weights[t, j] * expert_mlp(moe, int(routing.indices[t, j]), tokens[t], activation)
            for j in range(k))
        for t in range(tokens.shape[0])
    ])  # fmt: skip
    # fp32 grouped GEMMs against the float64 loop: sums of 64-128 products of O(1) values round to
    # ~1e-6 (k=4: 1.6e-6 from the exact value on this CPU; 1e-6 failed), a wrong route or weight is off by O(0.1)
    torch.testing.assert_close(out.reshape(-1, 32).double(), want, rtol=1e-5, atol=4e-6)


def test_dispatch_is_an_exact_permutation_grouped_by_expert() -> None:
    indices = torch.randint(0, 5, (40, 3), generator=gen(5))
    plan = plan_dispatch(indices, 5, 0, 5)
    assert sorted(plan.slots.tolist()) == list(range(120))  # every assignment exactly once
    experts = indices.reshape(-1)[plan.slots]
    assert torch.equal(experts, experts.sort().values)  # grouped by expert
    for e in range(5):  # tokens keep their order inside an expert
        assert plan.tokens[experts == e].tolist() == sorted(plan.tokens[experts == e].tolist())
    assert plan.counts.tolist() == torch.bincount(indices.reshape(-1), minlength=5).tolist()
    part = plan_dispatch(indices, 5, 2, 2)  # a tp rank's share: experts 2 and 3
    assert set(indices.reshape(-1)[part.slots].tolist()) <= {2, 3}
    assert part.counts.tolist() == plan.counts[2:4].tolist()
    # dispatch then combine with weight 1 and identity experts gives each token k copies of itself
    x = torch.randn(40, 8, generator=gen(6))
    gathered = x[plan.tokens]
    back = torch.zeros_like(x).index_add(0, plan.tokens, gathered)
    assert torch.equal(back, 3 * x)


@pytest.mark.parametrize("matmul", [grouped_matmul, padded_grouped_matmul])
def test_grouped_matmul_equals_a_loop_forward_and_backward(matmul) -> None:
    for width in (16, 6):  # 6 floats = 24 bytes: not 16-byte aligned, the loop fallback
        x = torch.randn(11, 8, generator=gen(7), requires_grad=True)
        w = torch.randn(3, 8, width, generator=gen(8), requires_grad=True)
        counts = torch.tensor([4, 0, 7])
        y = matmul(x, w, counts)
        want = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
        torch.testing.assert_close(y, want)
        y.sum().backward()  # an expanded gradient
        gx, gw = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        want.sum().backward()
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, w.grad)


# --- auxiliary losses ------------------------------------------------------------------------------
def test_load_balancing_loss_by_hand() -> None:
    # 4 tokens, 2 experts, top-1. Probabilities [0.8, 0.2] (x3) and [0.4, 0.6] (x1): tokens 0-2 go
    # to expert 0 and token 3 to expert 1, so f = [3/4, 1/4], P = [(2.4 + 0.4)/4, (0.6 + 0.6)/4]
    probs = torch.tensor([[0.8, 0.2]] * 3 + [[0.4, 0.6]])
    logits = probs.log()
    indices = torch.tensor([[0], [0], [0], [1]])
    expected = 2 * (0.75 * 0.7 + 0.25 * 0.3)
    assert float(load_balancing_loss(logits, indices)) == pytest.approx(expected, rel=1e-6)
    uniform = torch.zeros(6, 3)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2]] * 2))) == pytest.approx(1.0)
    # top-2: every assignment counts, shares over T*k
    two = torch.tensor([[0, 1], [0, 1], [0, 2]])
    share = torch.tensor([3, 2, 1]) / 6
    want = 3 * float((share * torch.softmax(torch.zeros(3, 3), -1).mean(0)).sum())
    assert float(load_balancing_loss(torch.zeros(3, 3), two)) == pytest.approx(want)


def test_z_loss_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4
    assert float(router_z_loss(logits)) == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


def test_aux_losses_reach_the_router_gradient_exactly_once() -> None:
    """The injected gradient equals the gradient of output.sum() + coeff * aux computed directly."""
    coeff, z_coeff = 0.3, 0.05
    x = torch.randn(8, 2, 32, generator=gen(9))
    injected = layer(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff).train()
    injected(x).sum().backward()
    direct = layer().train()  # same init, no aux objective of its own
    out = direct(x)
    routing = direct.router(x.reshape(-1, 32))
    objective = out.sum() + coeff * load_balancing_loss(routing.logits, routing.indices)
    (objective + z_coeff * router_z_loss(routing.logits)).backward()
    torch.testing.assert_close(injected.router.weight.grad, direct.router.weight.grad)
    plain = layer().train()
    plain(x).sum().backward()
    assert not torch.allclose(plain.router.weight.grad, injected.router.weight.grad)
    # the trainer's scale multiplies the injected gradient only
    scaled = layer(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff).train()
    scaled.aux_loss_scale = 0.0
    scaled(x).sum().backward()
    torch.testing.assert_close(scaled.router.weight.grad, plain.router.weight.grad)


def test_router_stats_are_recorded_in_training_only() -> None:
    moe = layer()
    x = torch.randn(8, 2, 32, generator=gen(10))
    moe.eval()
    moe(x)
    assert moe.stats.forwards == 0
    moe.train()
    with torch.no_grad():
        moe(x)  # e.g. the first pass of a recomputed (checkpointed) layer
    assert moe.stats.forwards == 0
    moe(x)
    moe(x)
    assert moe.stats.forwards == 2 and moe.stats.tokens == 32
    assert int(moe.stats.counts.sum()) == 2 * 16 * 2  # top-2


# --- every key changes what it should ----------------------------------------------------------------
def test_jitter_changes_routing_in_training_only() -> None:
    x = torch.randn(8, 2, 32, generator=gen(11))
    plain, jitter = layer(), layer(moe_jitter_eps=0.5)
    torch.manual_seed(0)
    assert not torch.equal(plain.train()(x), jitter.train()(x))
    assert torch.equal(plain.eval()(x), jitter.eval()(x))


def test_lbl_in_fp32_computes_the_losses_in_fp32() -> None:
    logits = torch.randn(8, 4, generator=gen(12)).bfloat16()
    indices = logits.float().topk(1).indices
    assert load_balancing_loss(logits, indices).dtype == torch.bfloat16
    assert load_balancing_loss(logits, indices, fp32=True).dtype == torch.float32
    assert router_z_loss(logits, fp32=True).dtype == torch.float32


def test_router_type_and_top_k_change_the_output() -> None:
    x = torch.randn(8, 2, 32, generator=gen(13))
    outs = [layer(moe_router_type=r, moe_top_k=k).train()(x) for r in ("topk", "sinkhorn") for k in (1, 2)]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert not torch.allclose(outs[i], outs[j])


def test_expert_interval_places_moe_layers_like_gpt_neox() -> None:
    cfg = GPTConfig(**{**BASE, **MOE, "num_layers": 5, "moe_expert_interval": 2})
    model = GPTModel(cfg)
    kinds = [type(block.mlp) for block in model.layers]
    assert kinds == [MoELayer, MLP, MoELayer, MLP, MoELayer]
    dense = GPTModel(GPTConfig(**BASE))
    assert all(type(block.mlp) is MLP for block in dense.layers)


def test_parameters_and_flops_count_active_experts() -> None:
    # intermediate_size sizes the dense MLP and each expert alike (GPT-NeoX's two rules agree on it)
    cfg = GPTConfig(**{**BASE, **MOE, "moe_expert_interval": 2, "intermediate_size": 128})  # layer 0 MoE, 1 dense
    model = GPTModel(cfg)
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    dense = GPTConfig(**BASE, intermediate_size=128)
    mlp = sum(p.numel() for p in MLP(dense, "m").parameters())
    router = 4 * 32
    assert num_parameters(cfg) == num_parameters(dense) + 3 * mlp + router
    assert num_parameters(cfg, active=True) == num_parameters(dense) + mlp + router  # top-2: one more
    assert flops_per_token(cfg) == flops_per_token(dense) + 6 * (mlp + router)


def test_model_trains_a_step_and_every_expert_gets_gradient() -> None:
    cfg = GPTConfig(**{**BASE, **MOE, "moe_aux_loss_coeff": 0.01})
    model = GPTModel(cfg).train()
    tokens = torch.randint(0, 64, (4, 8), generator=gen(14))
    lm_loss(model(tokens), tokens).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    w1 = model.layers[0].mlp.experts.w1.grad
    assert (w1.flatten(1).abs().sum(1) > 0).all()  # 64 tokens x top-2 reach all 4 experts


def test_config_rejects_top_k_above_experts() -> None:
    from megatron.errors import ConfigError

    with pytest.raises(ConfigError, match="moe_top_k=5"):
        GPTConfig(**{**BASE, "moe_num_experts": 4, "moe_top_k": 5}).check_architecture()
    with pytest.raises(ConfigError, match="moe_num_experts"):
        GPTConfig(**{**BASE, "moe_num_experts": 3}).check_tensor_parallel(2)


def test_partition_patterns_and_universal_merge_cover_experts(tmp_path) -> None:
    """Experts are tp-split on dim 0; DeepSpeed's tp merge with our info rebuilds every tensor."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str, merge_tp_slices
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megatron.checkpointing.universal import universal_checkpoint_info
    from megatron.model import tp_partition_of
    from megatron.mpu.initialize_weights import shard_tensor

    cfg = GPTConfig(**{**BASE, **MOE})  # every layer MoE
    model = GPTModel(cfg)
    tp = 2
    info = universal_checkpoint_info(cfg, tp)  # the implementation checkpoints use
    for name, p in model.named_parameters():
        part = tp_partition_of(cfg, name)
        assert is_model_parallel_parameter(p) == (part is not None), name
        full = p.detach()
        shards = [full if part is None else shard_tensor(full, part.dim, r, tp, part.sections) for r in range(tp)]
        for r, shard in enumerate(shards):
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                path = tmp_path / "slices" / name / str(r) / f"{state}.{dp_index_to_str(0)}"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(shard.flatten().clone(), path)
        merge_tp_slices(info, str(tmp_path / "out"), str(tmp_path / "slices"), tp, (name, [s.shape for s in shards]))
        merged = torch.load(tmp_path / "out" / name / "fp32.pt", weights_only=False)["param"]
        assert torch.equal(merged.reshape(full.shape), full), name
    assert tp_partition_of(cfg, "layers.1.mlp.experts.w2").dim == 0
    assert tp_partition_of(cfg, "layers.1.mlp.router.weight") is None


def test_a_changed_expert_parallel_size_is_refused_by_name(tmp_path) -> None:
    from megatron.checkpointing.expert_shards import check_expert_layout
    from megatron.errors import CheckpointError

    check_expert_layout({"moe_expert_parallel_size": 2}, {"moe_expert_parallel_size": 2}, tmp_path)
    check_expert_layout({}, {"moe_expert_parallel_size": 1}, tmp_path)  # saved before MoE existed
    with pytest.raises(CheckpointError, match="moe_expert_parallel_size=2, this run has 1.*resume with"):
        check_expert_layout({"moe_expert_parallel_size": 2}, {"moe_expert_parallel_size": 1}, tmp_path)


def test_expert_width_follows_gpt_neoxs_expert_rule() -> None:
    """GPT-NeoX's ParallelGroupedMLP (moe_mlp.py:159-166 at ea7aefd8): intermediate_size, else 4 x hidden
    rounded up to a multiple of 256 (not the dense MLP's rule)."""
    moe = GPTConfig(**{**BASE, **MOE})  # hidden 32: 4h = 128 -> 256
    model = GPTModel(moe)
    experts = model.layers[0].mlp.experts
    assert tuple(experts.w2.shape[1:]) == (256, 32) and moe.ffn_hidden_size == 128
    assert GPTConfig(**{**BASE, **MOE, "intermediate_size": 96}).expert_ffn_hidden_size == 96
