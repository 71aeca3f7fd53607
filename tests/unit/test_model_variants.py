"""GPTModel against an independent plain-torch reference, one architecture variant at a time.

The reference below is written from the maths (explicit softmax attention, explicit norms and
activations, rotary by pairs), not from the model code; it reads the model's own weights from its
state_dict. All weights, including norm gains and biases, are randomised first so that a wrong or
ignored parameter shows up in the logits.
"""

from __future__ import annotations

import math
import pytest
import torch

from gpt_configs import gpt_config

from megatron.model import GPTConfig, GPTModel, flops_per_token, lm_loss, num_parameters
from megatron.model.pipeline import (
    EmbeddingPipe,
    FinalNormPipe,
    OutputLayerPipe,
    TransformerLayerPipe,
    ValueHeadPipe,
    tied_embedding_logits,
)

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=7)


# --- the reference ---------------------------------------------------------------------------
def ref_norm(cfg: GPTConfig, sd: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    norm = cfg.norm.removeprefix("te_")  # Transformer Engine's kernels compute the same function
    if norm in ("layernorm", "non_parametric_layernorm"):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + cfg.layernorm_epsilon)
        if norm == "layernorm":
            y = y * sd[f"{prefix}.weight"]
            if cfg.use_bias_in_norms:
                y = y + sd[f"{prefix}.bias"]
        return y
    if norm == "rmsnorm":
        return x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.rms_norm_epsilon) * sd[f"{prefix}.weight"]
    if norm == "non_parametric_rmsnorm":  # Levanter's RmsNorm without a gain: no mean subtracted, no weight
        return x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.rms_norm_epsilon)
    if norm == "gemma_rmsnorm":  # Gemma: the gain is 1 + w
        return x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.rms_norm_epsilon) * (1 + sd[f"{prefix}.weight"])
    if norm == "scalenorm":
        length = torch.sqrt((x**2).sum(-1, keepdim=True))
        return x / torch.clamp(length, min=cfg.scalenorm_epsilon) * sd[f"{prefix}.g"]
    raise AssertionError(cfg.norm)


def ref_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    gelu = lambda t: 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))  # noqa: E731
    plain = {
        "gelu": gelu,
        "relu": lambda t: torch.where(t > 0, t, torch.zeros_like(t)),
        "silu": lambda t: t / (1.0 + torch.exp(-t)),
        "swish": lambda t: t / (1.0 + torch.exp(-t)),
        "softsign": lambda t: t / (1.0 + t.abs()),
        "mish": lambda t: t * torch.tanh(torch.log1p(torch.exp(t))),
    }
    if name in plain:
        return plain[name](x)
    gates = {
        "geglu": gelu,
        "geglu_tanh": lambda t: 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t**3))),
        "reglu": plain["relu"],
        "swiglu": plain["silu"],
        "bilinear": lambda t: t,
        "glu": lambda t: 1.0 / (1.0 + torch.exp(-t)),
    }
    half = x.shape[-1] // 2
    return gates[name](x[..., :half]) * x[..., half:]


def ref_rotary(x: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """x [b, n, s, d]; dims (i, i + rot/2) rotate together by angle pos * base^(-2i/rot)."""
    out = x.clone()
    half = rot // 2
    for i in range(half):
        angle = positions.float() * base ** (-2.0 * i / rot)  # [b|1, s]
        c, s_ = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * c - b * s_
        out[..., i + half] = b * c + a * s_
    return out


def ref_alibi_slopes(n: int) -> list[float]:
    def geometric(k: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / k) for i in range(k)]

    p = 1
    while p * 2 <= n:
        p *= 2
    return geometric(p) + geometric(2 * p)[::2][: n - p]


def ref_rpe_bucket(distance: int, num_buckets: int, max_distance: int) -> int:
    """T5's causal bucket of one distance: exact below num_buckets/2, then logarithmic."""
    exact = num_buckets // 2
    if distance < exact:
        return distance
    bucket = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(bucket, num_buckets - 1)


def ref_window(cfg: GPTConfig, layer: int) -> int | None:
    """Local layers of attention_config get the window; without any, every layer does."""
    types = []  # GPT-NeoX: each entry's list of types, repeated
    for kinds, repeats in cfg.attention_config or [[["global"], cfg.num_layers]]:
        types += list(kinds) * repeats
    if "local" in types:
        return cfg.sliding_window_width if types[layer] == "local" else None
    return cfg.sliding_window_width


def ref_attention(
    cfg: GPTConfig, sd: dict, prefix: str, x: torch.Tensor, positions, attention_mask, window: int | None
) -> torch.Tensor:
    b, s, _ = x.shape
    n, nkv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    w = sd[f"{prefix}.query_key_value.weight"]
    qkv = x @ w.T
    if cfg.use_bias_in_attn_linear or cfg.use_bias_in_qkv:  # Qwen2: the QKV's bias alone
        qkv = qkv + sd[f"{prefix}.query_key_value.bias"]
    q, k = qkv[..., : n * d], qkv[..., n * d : (n + nkv) * d]
    if cfg.use_qk_layernorm and cfg.qk_norm_scope == "projection":  # OLMo 2: over all heads' features at once
        q, k = ref_norm(cfg, sd, f"{prefix}.q_norm", q), ref_norm(cfg, sd, f"{prefix}.k_norm", k)
    q = q.reshape(b, s, n, d).transpose(1, 2)
    k = k.reshape(b, s, nkv, d).transpose(1, 2)
    v = qkv[..., (n + nkv) * d :].reshape(b, s, nkv, d).transpose(1, 2)
    if cfg.use_qk_layernorm and cfg.qk_norm_scope == "head":
        q = ref_norm(cfg, sd, f"{prefix}.q_norm", q)
        k = ref_norm(cfg, sd, f"{prefix}.k_norm", k)
    if cfg.pos_emb == "rotary":  # Gemma 3: the local layers' own base
        base = cfg.rope_local_base_freq if cfg.rope_local_base_freq and window is not None else cfg.rotary_emb_base
        q = ref_rotary(q, positions, cfg.rotary_dim, base)
        k = ref_rotary(k, positions, cfg.rotary_dim, base)
    group = n // nkv
    k = torch.stack([k[:, h // group] for h in range(n)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(n)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.query_pre_attn_scalar or d)  # [b, n, s, s]
    if cfg.attn_logit_softcapping:  # Gemma 2: c * tanh(scores / c)
        scores = cfg.attn_logit_softcapping * torch.tanh(scores / cfg.attn_logit_softcapping)
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    if cfg.pos_emb == "alibi":
        slopes = torch.tensor(ref_alibi_slopes(n)).view(1, n, 1, 1)
        scores = scores - slopes * (i - j).float()
    if cfg.pos_emb == "rpe":
        table = sd[f"{prefix}.relative_position_bias.weight"]  # [buckets, n]
        for qi in range(s):
            for kj in range(qi + 1):
                bucket = ref_rpe_bucket(qi - kj, cfg.rpe_num_buckets, cfg.rpe_max_distance)
                scores[:, :, qi, kj] += table[bucket]
    blocked = j > i
    if window is not None:
        blocked = blocked | (i - j > window)
    if attention_mask is not None:
        blocked = blocked | ~attention_mask
    scores = scores.masked_fill(blocked, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, n * d)
    out = ctx @ sd[f"{prefix}.dense.weight"].T
    return out + sd[f"{prefix}.dense.bias"] if cfg.use_bias_in_attn_linear else out


def ref_mlp(cfg: GPTConfig, sd: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    h = x @ sd[f"{prefix}.dense_h_to_4h.weight"].T
    if cfg.use_bias_in_mlp:
        h = h + sd[f"{prefix}.dense_h_to_4h.bias"]
    out = ref_activation(cfg.activation, h) @ sd[f"{prefix}.dense_4h_to_h.weight"].T
    return out + sd[f"{prefix}.dense_4h_to_h.bias"] if cfg.use_bias_in_mlp else out


def ref_logits(cfg: GPTConfig, sd: dict, tokens, position_ids=None, attention_mask=None) -> torch.Tensor:
    b, s = tokens.shape
    positions = torch.arange(s).view(1, s) if position_ids is None else position_ids
    x = sd["embedding.word_embeddings.weight"][tokens]
    if cfg.scale_embeddings_by_sqrt_hidden:  # Gemma
        x = x * math.sqrt(cfg.hidden_size)
    if cfg.pos_emb == "learned":
        x = x + sd["embedding.position_embeddings.weight"][positions + cfg.opt_pos_emb_offset]
    if cfg.pos_emb == "sinusoidal":
        h = cfg.hidden_size
        freqs = torch.tensor([10000.0 ** (-2.0 * i / h) for i in range(h // 2)])
        angles = positions.float()[..., None] * freqs
        x = x + torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}"
        ln1 = x if cfg.norm_placement == "post" else ref_norm(cfg, sd, f"{p}.input_layernorm", x)
        attn = ref_attention(cfg, sd, f"{p}.attention", ln1, positions, attention_mask, ref_window(cfg, layer))
        if cfg.gpt_j_residual:
            ln2 = ln1 if cfg.gpt_j_tied else ref_norm(cfg, sd, f"{p}.post_attention_layernorm", x)
            x = x + attn + ref_mlp(cfg, sd, f"{p}.mlp", ln2)
        elif cfg.norm_placement == "pre":
            x = x + attn
            x = x + ref_mlp(cfg, sd, f"{p}.mlp", ref_norm(cfg, sd, f"{p}.post_attention_layernorm", x))
        else:  # OLMo 2's post-norm: x + norm(attn(x)); Gemma 2's sandwich: x + norm(attn(norm(x)))
            x = x + ref_norm(cfg, sd, f"{p}.attention_output_norm", attn)
            mlp_in = x if cfg.norm_placement == "post" else ref_norm(cfg, sd, f"{p}.post_attention_layernorm", x)
            x = x + ref_norm(cfg, sd, f"{p}.mlp_output_norm", ref_mlp(cfg, sd, f"{p}.mlp", mlp_in))
    x = ref_norm(cfg, sd, "final_norm", x)
    if cfg.value_head:
        return x @ sd["value_head.weight"].T  # [b, s, 1]
    head = sd["output_layer.weight"] if cfg.no_weight_tying else sd["embedding.word_embeddings.weight"]
    cap = cfg.final_logit_softcapping  # Gemma 2: c * tanh(logits / c)
    return x @ head.T if cap is None else cap * torch.tanh(x @ head.T / cap)


# --- the variants ----------------------------------------------------------------------------
VARIANTS: dict[str, dict] = {
    "learned": dict(pos_emb="learned", max_position_embeddings=16),
    # GPT-NeoX's table has max_position_embeddings rows; the offset shifts positions inside it
    "learned_opt_offset": dict(pos_emb="learned", opt_pos_emb_offset=2, max_position_embeddings=10),
    "rotary": dict(pos_emb="rotary"),
    "rotary_pct_half": dict(pos_emb="rotary", rotary_pct=0.5, rotary_emb_base=500),
    "alibi_6_heads": dict(pos_emb="alibi", hidden_size=48, num_attention_heads=6),
    "sinusoidal": dict(pos_emb="sinusoidal"),
    "no_positions": dict(pos_emb="none"),
    "layernorm_no_bias": dict(norm="layernorm", use_bias_in_norms=False),
    "rmsnorm": dict(norm="rmsnorm"),
    "scalenorm": dict(norm="scalenorm"),
    "non_parametric_layernorm": dict(norm="non_parametric_layernorm"),
    "non_parametric_rmsnorm": dict(norm="non_parametric_rmsnorm", rms_norm_epsilon=0.1),
    **{f"act_{a}": dict(activation=a) for a in ["gelu", "relu", "silu", "swish", "softsign", "mish"]},
    # GPT-NeoX's gated width rule: int(96 * 2/3) = 64 rows, halves of 32 (its default 4h = 128 gives 85 and 42,
    # which it cannot run)
    **{f"act_{a}": dict(activation=a, intermediate_size=96) for a in ["geglu", "reglu", "swiglu", "bilinear", "glu"]},
    "gqa": dict(num_kv_heads=2, pos_emb="rotary"),
    "mqa": dict(num_kv_heads=1),
    "sliding_window": dict(sliding_window_width=3),
    "sliding_window_alibi": dict(sliding_window_width=2, pos_emb="alibi"),
    "local_then_global": dict(attention_config=[[["local", "global"], 1]], sliding_window_width=2),
    "rpe": dict(pos_emb="rpe", rpe_num_buckets=6, rpe_max_distance=5),
    "rpe_local": dict(pos_emb="rpe", attention_config=[[["global", "local"], 1]], sliding_window_width=3),
    "parallel_residual": dict(gpt_j_residual=True),
    "parallel_residual_tied_norm": dict(gpt_j_residual=True, gpt_j_tied=True),
    "qk_layernorm": dict(use_qk_layernorm=True, pos_emb="rotary"),
    "qk_rmsnorm": dict(use_qk_layernorm=True, norm="rmsnorm"),
    "untied": dict(no_weight_tying=True),
    "value_head": dict(value_head=True, pos_emb="rotary"),
    "no_linear_biases": dict(use_bias_in_attn_linear=False, use_bias_in_mlp=False),
    "qkv_bias_only": dict(use_bias_in_attn_linear=False, use_bias_in_qkv=True, use_bias_in_mlp=False, num_kv_heads=2),
    # heads of 12 channels, not hidden / heads = 8 (Qwen3, Gemma): q/k/v 4x12, 2x12, 2x12 wide, rotary over 6
    "head_dim": dict(kv_channels=12, num_kv_heads=2, pos_emb="rotary", rotary_pct=0.5, use_qk_layernorm=True,
                     norm="rmsnorm"),
    # OLMo 2's block: norms after attention and MLP only, RMSNorm over each whole q/k projection (GQA: k is narrower)
    "post_norm_qk_projection": dict(norm_placement="post", norm="rmsnorm", use_qk_layernorm=True,
                                    qk_norm_scope="projection", num_kv_heads=2, pos_emb="rotary"),
    # Gemma 2/3's block: norms before and after each sublayer
    "sandwich_norm": dict(norm_placement="sandwich", norm="rmsnorm"),
    # Gemma 2's pieces: (1 + w) norm, tanh GeGLU, scaled embeddings, query scalar, capped scores and logits, local
    # and global layers; Gemma 3's: query/key norms, no score cap, its own rotary base on the local layers
    "gemma2": dict(norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh", intermediate_size=96,
                   kv_channels=12, num_kv_heads=2, pos_emb="rotary", query_pre_attn_scalar=10.0,
                   attn_logit_softcapping=0.5, final_logit_softcapping=1.5, scale_embeddings_by_sqrt_hidden=True,
                   attention_config=[[["local", "global"], 1]], sliding_window_width=3),
    "gemma3": dict(norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh", intermediate_size=96,
                   kv_channels=12, num_kv_heads=2, pos_emb="rotary", query_pre_attn_scalar=10.0,
                   final_logit_softcapping=1.5, scale_embeddings_by_sqrt_hidden=True, use_qk_layernorm=True,
                   attention_config=[[["local", "global"], 1]], sliding_window_width=3, rope_local_base_freq=100),
    # GPT-NeoX's rule: int(40 * 2/3) = 26 rows rounded to 32, halves of 13 rounded to 16
    "mlp_width": dict(intermediate_size=40, mlp_multiple_of=8, activation="swiglu"),
    "expansion_factor": dict(expansion_factor=2.5),
}


def build(variant: dict) -> tuple[GPTConfig, GPTModel]:
    cfg = gpt_config(**{**BASE, **variant})
    model = GPTModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # make every parameter matter (init leaves norms at 1 and biases at 0)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return cfg, model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_reference(name: str) -> None:
    cfg, model = build(VARIANTS[name])
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens)
        want = ref_logits(cfg, model.state_dict(), tokens)
    assert got.shape == (2, cfg.seq_length, 1 if cfg.value_head else cfg.padded_vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos_emb", ["learned", "rotary", "sinusoidal"])
def test_position_ids_and_attention_mask(pos_emb: str) -> None:
    cfg, model = build(dict(pos_emb=pos_emb))
    s = cfg.seq_length
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, s), generator=torch.Generator().manual_seed(2))
    # two documents per row (GPT-NeoX reset_position_ids / reset_attention_mask)
    position_ids = torch.cat([torch.arange(3), torch.arange(s - 3)]).expand(2, s)
    doc = (torch.arange(s) >= 3).long()
    mask = (doc.view(s, 1) == doc.view(1, s)).expand(2, 1, s, s)
    with torch.no_grad():
        got = model(tokens, position_ids, mask)
        want = ref_logits(cfg, model.state_dict(), tokens, position_ids, mask)
        plain = model(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the inputs were not ignored


def test_lm_loss_matches_torch_cross_entropy() -> None:
    cfg, model = build({})
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    labels = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    labels[0, :3] = -100
    loss_mask = torch.ones(2, cfg.seq_length)
    loss_mask[1, -2:] = 0
    logits = model(tokens)
    got = lm_loss(logits, labels, loss_mask)
    masked = labels.masked_fill(loss_mask == 0, -100)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), masked.flatten(), ignore_index=-100)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize("name", ["learned", "untied", "alibi_6_heads", "gqa", "value_head"])
def test_pipeline_layers_compute_the_same_model(name: str) -> None:
    """The pipeline's layer classes, chained by hand, build the same weights and logits."""
    cfg = gpt_config(**{**BASE, **VARIANTS[name]})
    model = GPTModel(cfg).eval()
    embed = EmbeddingPipe(cfg)
    layers = [TransformerLayerPipe(cfg, i) for i in range(cfg.num_layers)]
    norm = FinalNormPipe(cfg)
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    with torch.no_grad():
        x = embed(tokens)
        for layer in layers:
            x = layer(x)
        x = norm(x)
        if cfg.value_head:
            value_head = ValueHeadPipe(cfg)
            got = value_head(x)
            assert torch.equal(value_head.value_head.weight, model.value_head.weight)
        elif cfg.no_weight_tying:
            head = OutputLayerPipe(cfg)
            got = head(x)
            assert torch.equal(head.output_layer.weight, model.output_layer.weight)
        else:
            got = tied_embedding_logits(embed, x)
        want = model(tokens)
    for i, layer in enumerate(layers):
        for key, value in layer.state_dict().items():
            assert torch.equal(value, model.state_dict()[f"layers.{i}.{key}"]), key
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_init_is_a_function_of_seed_and_name() -> None:
    cfg = GPTConfig(**BASE)
    a, b = GPTModel(cfg).state_dict(), GPTModel(cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    qkv0, qkv1 = a["layers.0.attention.query_key_value.weight"], a["layers.1.attention.query_key_value.weight"]
    assert not torch.allclose(qkv0, qkv1)  # the layer number is part of the name
    other = GPTModel(cfg.replace(seed=8)).state_dict()
    assert not torch.allclose(a["embedding.word_embeddings.weight"], other["embedding.word_embeddings.weight"])
    # std: normal(0.02) for inputs, scaled by 1/sqrt(2L) for residual outputs
    assert abs(qkv0.std().item() - 0.02) < 0.003
    dense = a["layers.0.attention.dense.weight"]
    assert abs(dense.std().item() - 0.02 / math.sqrt(2 * cfg.num_layers)) < 0.002


@pytest.mark.parametrize(
    "name",
    ["learned", "learned_opt_offset", "gqa", "untied", "value_head", "qk_rmsnorm", "parallel_residual_tied_norm",
     "mlp_width", "rpe", "qkv_bias_only", "head_dim", "post_norm_qk_projection", "sandwich_norm", "gemma3"],
)
def test_num_parameters_and_flops(name: str) -> None:
    cfg, model = build(VARIANTS[name])
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    h, L, s, v = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.padded_vocab_size
    table = cfg.max_positions
    embeddings = v * h + (table * h if cfg.pos_emb == "learned" else 0)
    head = h if cfg.value_head else v * h
    untied_head = head if (cfg.no_weight_tying or cfg.value_head) else 0
    matmul = num_parameters(cfg) - embeddings - untied_head + head
    width = cfg.num_attention_heads * (cfg.kv_channels or h // cfg.num_attention_heads)  # the heads' q.k and p.v
    assert flops_per_token(cfg, s) == 6 * matmul + 12 * L * width * s


def test_config_from_neox_args() -> None:
    from megatron.neox_arguments import config_from_mapping

    args = config_from_mapping(dict(
        num_layers=3, hidden_size=48, num_attention_heads=6, seq_length=32, padded_vocab_size=96,
        pos_emb="rotary", rotary_pct=0.25, norm="rmsnorm", activation="swiglu", intermediate_size=576, precision="bfloat16",
        attention_config=[[["global"], "all"]], train_iters=10, lr=1e-3,  # not architecture: not read
    )).args
    cfg = args  # the arguments are the model's config: no copy
    assert isinstance(cfg, GPTConfig)
    assert (cfg.num_layers, cfg.kv_heads, cfg.max_positions) == (3, 6, 32)
    assert cfg.params_dtype == torch.bfloat16 and cfg.rotary_dim == 2 and cfg.padded_vocab_size == 96
    assert cfg.attention_types == ["global"] * 3
    assert cfg.layernorm_epsilon == 1e-5  # the schema's default
    assert not cfg.value_head and cfg.with_vocab(128).padded_vocab_size == 128
    with pytest.raises(ValueError, match="not supported"):
        GPTConfig(**BASE, attention_config=[[["sparse_fixed"], "all"]]).check_architecture()
    with pytest.raises(ValueError, match="not a registered norm"):  # the norm registry's names (or a plug-in's)
        GPTConfig(**BASE, norm="batchnorm")
    for bad in (dict(pos_emb="t5"), dict(activation="tanh"), dict(init_method="zeros")):
        with pytest.raises(ValueError, match="Input should be"):  # not even a GPT-NeoX value: the schema refuses it
            GPTConfig(**BASE, **bad)
    with pytest.raises(ValueError, match="needs sliding_window_width"):
        GPTConfig(**BASE, attention_config=[[["local"], "all"]]).check_architecture()


def test_activation_checkpointing_replays_dropout() -> None:
    """With DeepSpeed's checkpoint, the recomputed layers draw the same dropout masks."""
    from megatron.mpu import model_parallel_manual_seed

    cfg = GPTConfig(**BASE, hidden_dropout=0.2, attention_dropout=0.2, pos_emb="rotary")
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    labels = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    from megatron.engine.activation_config import ActivationCheckpointArgs
    from megatron.engine.build import wrap_layers

    runs = []
    for on in (False, True):
        model = GPTModel(cfg).train()
        # what build_model does (without a process group, so without configure's mpu options)
        wrap_layers(model, ActivationCheckpointArgs(checkpoint_activations=on), compile_layers=False,
                    pipe_interval_used=False)
        assert ("forward" in vars(model.layers[0])) == on  # recompute wrapper installed per instance
        model_parallel_manual_seed(5)
        loss = lm_loss(model(tokens), labels)
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    model_parallel_manual_seed(6)
    other = lm_loss(GPTModel(cfg).train()(tokens), labels)
    assert not torch.allclose(other, runs[0][0])  # dropout is really on
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=0, rtol=0)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b)


def test_checkpoint_num_layers_chunks_blocks_without_a_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint_num_layers = k`` without a pipeline: one DeepSpeed checkpoint per k consecutive
    blocks (4 blocks, k=2: two checkpoint calls, not four), and the same loss and gradients as the
    model without checkpointing."""
    import deepspeed

    from megatron.engine.activation_config import ActivationCheckpointArgs
    from megatron.engine.build import wrap_layers

    calls: list[int] = []
    real = deepspeed.checkpointing.checkpoint
    monkeypatch.setattr(deepspeed.checkpointing, "checkpoint", lambda fn, *a: calls.append(1) or real(fn, *a))
    cfg = GPTConfig(**{**BASE, "num_layers": 4})
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length))
    runs = []
    for ckpt in (ActivationCheckpointArgs(), ActivationCheckpointArgs(checkpoint_activations=True),
                 ActivationCheckpointArgs(checkpoint_activations=True, checkpoint_num_layers=2)):
        calls.clear()
        model = GPTModel(cfg).train()
        wrap_layers(model, ckpt, compile_layers=False, pipe_interval_used=False)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        runs.append((len(calls), loss.detach(), [p.grad for p in model.parameters()]))
    assert [n for n, *_ in runs] == [0, 4, 2]
    for _, loss, grads in runs[1:]:
        torch.testing.assert_close(loss, runs[0][1], atol=0, rtol=0)
        for a, b in zip(grads, runs[0][2]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["learned", "gqa", "untied", "qk_rmsnorm", "act_swiglu", "no_linear_biases",
                                  "parallel_residual_tied_norm", "non_parametric_layernorm", "value_head", "rpe",
                                  "qkv_bias_only", "head_dim", "post_norm_qk_projection", "sandwich_norm",
                                  "gemma3"])
def test_universal_checkpoint_info_merges_tp_shards(name: str, tmp_path) -> None:
    """DeepSpeed's own tp-merge (ds_to_universal.merge_tp_slices), fed our shards and our
    `universal_checkpoint_info`, rebuilds every full tensor (the converter runs with --no_strict:
    patterns of parameters this variant lacks, e.g. an untied output layer, may stay unused)."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str, merge_tp_slices

    from megatron.checkpointing.universal import universal_checkpoint_info
    from megatron.model import tp_partition_of
    from megatron.mpu.initialize_weights import shard_tensor

    tp = 2
    cfg, model = build(VARIANTS[name])
    info = universal_checkpoint_info(cfg, tp)  # the implementation checkpoints use
    for pname, full in model.state_dict().items():
        part = tp_partition_of(cfg, pname)
        shards = [full if part is None else shard_tensor(full, part.dim, r, tp, part.sections) for r in range(tp)]
        for r, shard in enumerate(shards):
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                path = tmp_path / "slices" / pname / str(r) / f"{state}.{dp_index_to_str(0)}"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(shard.flatten().clone(), path)
        merge_tp_slices(info, str(tmp_path / "out"), str(tmp_path / "slices"), tp, (pname, [s.shape for s in shards]))
        merged = torch.load(tmp_path / "out" / pname / "fp32.pt", weights_only=False)["param"]
        assert torch.equal(merged.reshape(full.shape), full), pname  # padded vocabulary rows kept


@pytest.mark.parametrize("name", ["learned", "rotary_pct_half", "alibi_6_heads", "sliding_window", "gqa", "sinusoidal",
                                  "parallel_residual", "value_head", "rpe", "local_then_global",
                                  "post_norm_qk_projection", "gemma2", "gemma3"])
def test_incremental_decoding_with_kv_cache(name: str) -> None:
    """Prefill then one token at a time through a KVCache gives the full forward's outputs."""
    from megatron.model import KVCache

    cfg, model = build(VARIANTS[name])
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :5], kv_cache=cache)]
        steps += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(5, cfg.seq_length)]
    assert cache.seen == cfg.seq_length
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_config_errors_are_config_errors() -> None:
    """Architecture mistakes reach the entry points as ConfigError (clean exit 2), naming the keys."""
    from megatron.errors import ConfigError

    with pytest.raises(ConfigError, match="hidden_size=30"):
        GPTConfig(**{**BASE, "hidden_size": 30}).check_architecture()
    cfg = GPTConfig(**{**BASE, "num_kv_heads": 1, "intermediate_size": 50})
    cfg.check_tensor_parallel(1)
    with pytest.raises(ConfigError, match=r"num_kv_heads=1, .*MLP width.*=50"):
        cfg.check_tensor_parallel(4)


@pytest.mark.parametrize("name", ["learned", "gqa", "untied", "act_swiglu", "rpe", "qk_layernorm", "value_head",
                                  "qkv_bias_only", "head_dim", "post_norm_qk_projection", "sandwich_norm",
                                  "gemma3"])
def test_partition_patterns_agree_with_parameter_marks(name: str) -> None:
    """The name patterns (checkpoint resharding) and the attributes DeepSpeed reads agree."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megatron.model import tp_partition_of

    cfg, model = build(VARIANTS[name])
    for pname, p in model.named_parameters():
        part = tp_partition_of(cfg, pname)
        assert is_model_parallel_parameter(p) == (part is not None), pname
        if part is not None:
            assert p.partition_dim == part.dim, pname
            assert (p.partition_sections or [p.shape[part.dim]]) == list(part.sections or [p.shape[part.dim]]), pname


def test_attention_config_expands_like_gpt_neox() -> None:
    """Each entry's types repeat as a list; "all" fills num_layers; the total must be num_layers."""
    from megatron.model.config import expand_attention_config

    assert expand_attention_config([[["global", "local"], 2]], 4) == ["global", "local", "global", "local"]
    assert expand_attention_config([[["local"], 1], [["global"], 3]], 4) == ["local", "global", "global", "global"]
    assert expand_attention_config([[["global", "local"], "all"]], 6) == ["global", "local"] * 3
    with pytest.raises(ValueError, match="describes 3 layers but num_layers=4"):
        expand_attention_config([[["global"], 3]], 4)
    with pytest.raises(ValueError, match="describes 5 layers but num_layers=4"):
        expand_attention_config([[["global"], 5]], 4)  # too long is refused, not truncated
    with pytest.raises(ValueError, match="do not divide num_layers=5"):
        expand_attention_config([[["global", "local"], "all"]], 5)
    # the per-layer type decides the window: local layers attend within sliding_window_width
    cfg = GPTConfig(**{**BASE, "num_layers": 2}, attention_config=[[["local", "global"], 1]], sliding_window_width=3)
    assert [cfg.attention_window(i) for i in range(2)] == [3, None]
