"""Transformer Engine and bitsandbytes modules on an NVIDIA GPU (skipped elsewhere; run by ``deepy-gpu-check``'s
``gpu_libraries`` check): each swapped module computes what Deepy's torch module it replaces computes, with the
same weights (the reference is Deepy's own layer, checked against plain torch in test_model_variants.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron.config_schema import BITSANDBYTES, TRANSFORMER_ENGINE, gpu_library_missing
from megatron.model import GPTModel
from megatron.model.norms import build_norm
from megatron.model.transformer_engine import apply_transformer_engine, fp8_recipe_arguments
from tests.gpt_configs import gpt_config

TE_MISSING = gpu_library_missing(TRANSFORMER_ENGINE)
BNB_MISSING = gpu_library_missing(BITSANDBYTES)
needs_te = pytest.mark.skipif(TE_MISSING is not None, reason=f"Transformer Engine: {TE_MISSING}")
needs_bnb = pytest.mark.skipif(BNB_MISSING is not None, reason=f"bitsandbytes: {BNB_MISSING}")

BASE: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, padded_vocab_size=128,
                            max_position_embeddings=16, pos_emb="rotary", attention_dropout=0.0, hidden_dropout=0.0)


def _logits(keys: dict[str, Any], swap: bool) -> torch.Tensor:
    cfg = gpt_config(**{**BASE, **keys})
    torch.manual_seed(0)
    model = GPTModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter matters (init leaves norms at 1 and biases at 0)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    if swap:
        apply_transformer_engine(model, cfg)
    model = model.cuda()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        out: torch.Tensor = model(tokens).float()
    return out


@needs_te
@pytest.mark.parametrize("keys", [dict(te_columnparallel=True), dict(te_rowparallel=True),
                                  dict(te_layernorm_mlp=True), dict(te_layernorm_mlp=True, activation="swiglu"),
                                  dict(te_mha=True), dict(te_mha=True, num_kv_heads=2),
                                  dict(te_columnparallel=True, te_rowparallel=True, te_mha=True, te_layernorm_mlp=True)])
def test_te_modules_compute_what_deepys_layers_compute(keys: dict[str, Any]) -> None:
    want = _logits(keys, swap=False)
    got = _logits(keys, swap=True)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@needs_te
def test_te_fp8_mha_runs_each_block_under_the_te_fp8_recipe() -> None:
    import transformer_engine.pytorch as te

    keys = dict(te_fp8_mha=True, te_fp8_format="hybrid", te_fp8_amax_history_len=4, te_fp8_margin=1,
                te_fp8_wgrad=False, precision="bfloat16")
    cfg = gpt_config(**{**BASE, **keys})
    model = GPTModel(cfg)
    apply_transformer_engine(model, cfg)
    model = model.cuda().to(torch.bfloat16)
    seen: list[Any] = []
    layer: Any = model.layers[0]
    layer.attention.register_forward_hook(lambda *_: seen.append(te.fp8.FP8GlobalStateManager.get_fp8_recipe()))
    logits = model(torch.randint(0, 128, (2, 16)).cuda())
    logits.float().sum().backward()
    recipe = seen[0]
    assert recipe.margin == 1 and recipe.amax_history_len == 4 and recipe.fp8_mha
    assert recipe.override_linear_precision.wgrad and str(recipe.fp8_format).endswith("HYBRID")
    assert fp8_recipe_arguments(cfg)["margin"] == 1 and torch.isfinite(logits).all()


@needs_te
@pytest.mark.parametrize(("norm", "eps_key"), [("te_rmsnorm", "rms_norm_epsilon"), ("te_layernorm", "layernorm_epsilon")])
def test_te_norms_are_transformer_engines_with_the_epsilon_keys(norm: str, eps_key: str) -> None:
    cfg = gpt_config(**{**BASE, "norm": norm, eps_key: 1e-3})
    module: Any = build_norm(cfg.norm_settings)
    x = torch.randn(4, 64, device="cuda")
    torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    with torch.no_grad():
        if norm == "te_rmsnorm":
            want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3) * module.weight
        else:
            want = torch.nn.functional.layer_norm(x, (64,), module.weight, module.bias, 1e-3)
        torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4)
    assert type(module).__module__.startswith("transformer_engine")


@needs_bnb
def test_use_bnb_optimizer_builds_adam8bit_and_stable_position_embeddings() -> None:
    import bitsandbytes as bnb

    from megatron.engine.bnb import stable_position_embeddings
    from megatron.engine.optimizer_config import OptimizerArgs
    from megatron.engine.optimizers import build_optimizer

    cfg = gpt_config(**{**BASE, "pos_emb": "learned"})
    model: Any = GPTModel(cfg)
    table = model.embedding.position_embeddings.weight.detach().clone()
    assert stable_position_embeddings(model) == 1
    model = model.cuda()
    positions = torch.arange(16, device="cuda")[None]
    want = torch.nn.functional.layer_norm(table.cuda()[positions], (64,))  # StableEmbedding: lookup, LayerNorm
    torch.testing.assert_close(model.embedding.position_embeddings(positions), want, rtol=1e-5, atol=1e-5)
    args = OptimizerArgs.model_validate({"use_bnb_optimizer": True, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    optimizer = build_optimizer(model, args)
    assert isinstance(optimizer, bnb.optim.Adam8bit)
    model(torch.randint(0, 128, (2, 16)).cuda()).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
