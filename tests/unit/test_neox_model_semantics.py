"""GPT-NeoX's architecture keys mean here what they mean in GPT-NeoX's code (EleutherAI/gpt-neox at
ea7aefd8, docs/gpt_neox_semantics.md): the published models come out at their published sizes, the
widths, norms, rotary dims and initialisers follow GPT-NeoX's formulas, and what GPT-NeoX cannot build
is refused before launch.

References are independent of Deepy's code: transformers' Llama/GPTNeoX/Mistral classes built on the
meta device and counted, the published parameter counts, and formulas written out in the tests (each
with the GPT-NeoX file:line it comes from). The GPT-NeoX configs' shapes are stated here key by key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron.config_rules import Device
from megatron.errors import ConfigError
from megatron.model.config import GPTConfig, ModelConfigError
from megatron.model.flops import num_parameters
from megatron.model.gpt import GPTModel
from megatron.model.mlp import MLP
from megatron.model.mlp_width import GATED_ACTIVATIONS
from megatron.neox_arguments import finalize, load_config
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.neox_arguments.run_config import RunConfig
from megatron.tokenizer import padded_vocab_size
from megatron.engine.memory import MemoryLayout, dry_run_report, stage_parameters

REPO = Path(__file__).resolve().parents[2]
GPU = Device(cuda=True, fp16_supported=True)

# GPT-NeoX's configs/llama/7B.yml at ea7aefd8: the architecture keys, as that file sets them
NEOX_LLAMA_7B: dict[str, Any] = dict(
    num_layers=32, hidden_size=4096, intermediate_size=32768, mlp_multiple_of=256, num_attention_heads=32,
    seq_length=2048, max_position_embeddings=2048, pos_emb="rotary", rotary_pct=1, no_weight_tying=True,
    gpt_j_residual=False, norm="rmsnorm", rms_norm_epsilon=1e-6, use_bias_in_mlp=False, use_bias_in_norms=False,
    use_bias_in_attn_linear=False, activation="swiglu",
)
# configs/llama2/7B.yml: the same shapes, 4096 tokens, eps 1e-5, and no use_bias_in_mlp (GPT-NeoX's default, true)
NEOX_LLAMA2_7B = {key: value for key, value in NEOX_LLAMA_7B.items() if key != "use_bias_in_mlp"}
NEOX_LLAMA2_7B.update(seq_length=4096, max_position_embeddings=4096, rms_norm_epsilon=1e-5)
# configs/mistral/7B.yml: intermediate_size 14336 with the default mlp_multiple_of (1)
NEOX_MISTRAL_7B: dict[str, Any] = dict(
    num_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_kv_heads=8,
    seq_length=8192, sliding_window_width=4096, max_position_embeddings=131072, pos_emb="rotary", rotary_pct=1,
    rotary_emb_base=10000, no_weight_tying=True, gpt_j_residual=False, norm="rmsnorm", rms_norm_epsilon=1e-5,
    use_bias_in_norms=False, use_bias_in_attn_linear=False, activation="swiglu",
)
# configs/pythia/410M.yml: GPT-NeoX's defaults elsewhere (layernorm with biases, gelu, biases everywhere)
NEOX_PYTHIA_410M: dict[str, Any] = dict(
    num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048, max_position_embeddings=2048,
    pos_emb="rotary", rotary_pct=0.25, no_weight_tying=True, gpt_j_residual=True,
    init_method="small_init", output_layer_init_method="wang_init",
)

LLAMA_2_7B_PUBLISHED = 6_738_415_616  # Llama-2-7B (and LLaMA-7B), 32,000-token vocabulary
PYTHIA_410M_PUBLISHED = 405_334_016  # Pythia-410M (the Pythia paper's table; 50,304 padded rows)
PYTHIA_410M_NON_EMBEDDING = 302_311_424


def hf_count(kind: str, **fields: Any) -> int:
    """Parameters of transformers' own model of that kind, built on the meta device."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM),
    }[kind]
    with torch.device("meta"):
        model = model_class(config_class(**fields))
    return sum(p.numel() for p in model.parameters())


def built_count(config: GPTConfig) -> int:
    """Parameters of Deepy's model as it builds it (meta device: shapes only; drawing values on the meta
    device is slow in torch and says nothing about sizes, so the normal draw is skipped)."""
    from unittest import mock

    with torch.device("meta"), mock.patch.object(torch.nn.init, "normal_", lambda t, *a, **k: t):
        model = GPTModel(config)
    return sum(p.numel() for p in model.parameters())


def counts_agree(config: GPTConfig) -> int:
    """The model built, flops.num_parameters (MFU) and the memory estimate's count (tp1, pp1) agree."""
    built = built_count(config)
    assert num_parameters(config) == built
    layout = MemoryLayout(model=config, tp=1, pp=1, dp=1, precision="bf16", zero_stage=0, offload_optimizer=False,
                          contiguous_gradients=True, overlap_comm=False, reduce_bucket_size=0, optimizer_states=2,
                          micro_batch=1, seq_length=config.seq_length, grad_accum=1, recomputed_layers=0,
                          sequence_parallel=False, dropout=False)
    assert stage_parameters(layout) == built
    return built


def shipped(name: str, tokenizer_vocab: int) -> GPTConfig:
    """One of our configs, sized for a tokenizer as GPT-NeoX pads it (make_vocab_size_divisible_by x tp)."""
    args = NeoXArgs(**yaml.safe_load((REPO / "configs" / name).read_text()))
    return args.with_vocab(args.padded(tokenizer_vocab, args.model_parallel_size))


# --- published sizes -------------------------------------------------------------------------------
def test_llama_7b_from_gpt_neox_keys_is_the_published_size() -> None:
    config = GPTConfig(**NEOX_LLAMA_7B, padded_vocab_size=32000)
    assert (config.mlp_widths.first, config.ffn_hidden_size) == (22016, 11008)
    hf = hf_count("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, tie_word_embeddings=False)
    assert counts_agree(config) == hf == LLAMA_2_7B_PUBLISHED
    # ours: configs/llama/7B.yml and llama2/7B.yml (SPM's 32,000 tokens, tp 2, make_vocab_size_divisible_by 1)
    for name in ("llama/7B.yml", "llama2/7B.yml"):
        assert num_parameters(shipped(name, 32000)) == LLAMA_2_7B_PUBLISHED, name


def test_gpt_neox_llama2_file_adds_mlp_biases() -> None:
    """configs/llama2/7B.yml leaves use_bias_in_mlp at GPT-NeoX's default (true): its model carries the
    first projection's 22016 and the second's 4096 biases in each of the 32 layers."""
    config = GPTConfig(**NEOX_LLAMA2_7B, padded_vocab_size=32000)
    assert config.use_bias_in_mlp
    assert counts_agree(config) == LLAMA_2_7B_PUBLISHED + 32 * (22016 + 4096)


def test_pythia_410m_from_gpt_neox_keys_is_the_published_size() -> None:
    vocab = padded_vocab_size(50277, 128, 1)  # GPT-NeoX-20B's tokenizer, padded as GPT-NeoX pads it
    assert vocab == 50304
    config = GPTConfig(**NEOX_PYTHIA_410M, padded_vocab_size=vocab)
    hf = hf_count("gpt_neox", vocab_size=vocab, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
    assert counts_agree(config) == hf == PYTHIA_410M_PUBLISHED
    assert num_parameters(config, include_embeddings=False) == PYTHIA_410M_NON_EMBEDDING
    assert num_parameters(shipped("pythia/410M.yml", 50277)) == PYTHIA_410M_PUBLISHED


def test_our_mistral_is_mistral_7b() -> None:
    """configs/mistral/7B.yml writes intermediate_size 43008 = 3 x 14336, which GPT-NeoX's rule turns
    into Mistral's 14336-wide halves."""
    config = shipped("mistral/7B.yml", 32000)
    assert config.ffn_hidden_size == 14336 and not config.use_bias_in_mlp
    hf = hf_count("mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    assert counts_agree(config) == hf == 7_241_732_096


# --- what GPT-NeoX cannot build is refused before launch ------------------------------------------------
def test_gpt_neox_mistral_file_is_refused_saying_what_to_set(tmp_path: Path) -> None:
    """GPT-NeoX's rule on 14336 with mlp_multiple_of 1: int(14336 x 2/3) = 9557 rows rounded up to an even
    9558, so gate halves of 4779, against a second projection of 9557 // 2 = 4778 inputs."""
    path = tmp_path / "7B.yml"
    path.write_text(yaml.safe_dump({**NEOX_MISTRAL_7B, "train_iters": 10, "use_dummy_dataset": True,
                                    "tokenizer_type": "CharLevelTokenizer"}, sort_keys=False))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("intermediate_size"))
    with pytest.raises(ConfigError) as err:
        finalize(load_config([str(path)]), 1, device=GPU)
    message = err.value.message
    assert f"intermediate_size=14336 ({path}:{line})" in message
    assert "gate halves of 4779 against a 4778-wide second projection" in message
    assert "intermediate_size: 43008 with mlp_multiple_of: 1 for a 14336-wide MLP" in message
    # the model's own guard says the same to tools that build it directly
    with pytest.raises(ModelConfigError, match="intermediate_size: 43008"):
        GPTConfig(**NEOX_MISTRAL_7B, padded_vocab_size=32000).check_architecture()


@pytest.mark.parametrize(
    ("keys", "widths"),
    [
        # transformer.py:117-143 at ea7aefd8, computed by hand: (first projection rows, second projection inputs)
        (dict(hidden_size=4096, intermediate_size=32768, mlp_multiple_of=256, activation="swiglu"), (22016, 11008)),
        (dict(hidden_size=4096, mlp_multiple_of=256, activation="swiglu"), (11264, 5632)),  # 4h: 10922, 5461 rounded
        (dict(hidden_size=1024), (4096, 4096)),  # plain gelu: 4h, nothing rounded
        (dict(hidden_size=64, expansion_factor=2.5), (160, 160)),  # int(2.5 x 64)
        (dict(hidden_size=64, intermediate_size=40, mlp_multiple_of=8, activation="geglu"), (32, 16)),  # 26->32, 13->16
        (dict(hidden_size=64, intermediate_size=300, mlp_multiple_of=128), (512, 384)),  # refused: 512 != 384
        (dict(hidden_size=64, intermediate_size=75), (76, 75)),  # refused: an odd plain width
        (dict(hidden_size=4096, activation="swiglu"), (10922, 5461)),  # 4h = 16384: halves of 5461
        (dict(hidden_size=32, activation="swiglu"), (86, 42)),  # refused: 4h = 128 gives 85 rows -> 86, and 42
    ],
)
def test_mlp_widths_follow_gpt_neox(keys: dict[str, Any], widths: tuple[int, int]) -> None:
    base = dict(num_layers=1, num_attention_heads=4, seq_length=8, padded_vocab_size=64)
    config = GPTConfig(**base, **keys)
    first, second = widths
    assert (config.mlp_widths.first, config.mlp_widths.second) == widths
    gated = config.activation in GATED_ACTIVATIONS
    if first == (2 * second if gated else second):
        with torch.device("meta"):
            mlp = MLP(config, "mlp")
        assert tuple(mlp.dense_h_to_4h.weight.shape) == (first, config.hidden_size)
        assert tuple(mlp.dense_4h_to_h.weight.shape) == (config.hidden_size, second)
    else:
        with pytest.raises(ModelConfigError, match="GPT-NeoX cannot run"):
            config.check_architecture()


def test_intermediate_size_and_expansion_factor_together_are_refused() -> None:
    """GPT-NeoX asserts that only one of them is given (transformer.py:106-108)."""
    config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, intermediate_size=128,
                       expansion_factor=2.0)
    with pytest.raises(ModelConfigError, match="both size the MLP"):
        config.check_architecture()


def test_gated_activations_are_gpt_neoxs() -> None:
    """activations.py get_activation: is_gated for geglu, reglu, bilinear, swiglu and glu only."""
    from megatron.model.activations import ACTIVATIONS

    assert {name for name, act in ACTIVATIONS.items() if act.gated} == GATED_ACTIVATIONS
    # GPT-NeoX's five, and Gemma's tanh GeGLU (a Deepy extra: gelu_pytorch_tanh gated, modeling_gemma2.py)
    assert GATED_ACTIVATIONS == {"geglu", "reglu", "bilinear", "swiglu", "glu", "geglu_tanh"}


def test_bias_gelu_fusion_computes_gpt_neoxs_tanh_gelu() -> None:
    """activations.py:45-53, 78-81: with bias_gelu_fusion, gelu is bias_gelu, the tanh approximation."""
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8, intermediate_size=32, seed=3)
    fused, exact = MLP(GPTConfig(**base, bias_gelu_fusion=True), "mlp"), MLP(GPTConfig(**base), "mlp")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights of unit scale, the same in both, so the two GeLUs differ visibly
        for a, b in zip(fused.parameters(), exact.parameters()):
            a.copy_(torch.randn(a.shape, generator=gen)), b.copy_(a)
    x = torch.randn(5, 1, 16, generator=gen)
    pre = x @ fused.dense_h_to_4h.weight.T + fused.dense_h_to_4h.bias
    tanh_gelu = pre * 0.5 * (1.0 + torch.tanh(0.79788456 * pre * (1 + 0.044715 * pre * pre)))
    want = tanh_gelu @ fused.dense_4h_to_h.weight.T + fused.dense_4h_to_h.bias
    with torch.no_grad():
        torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-6)
        assert (fused(x) - exact(x)).abs().max() > 1e-3  # the same weights with the exact erf GeLU


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        # transformer.py:1102-1113: without an MLP bias the parallel residual's output is the MLP's alone
        (dict(gpt_j_residual=True, use_bias_in_mlp=False), "drops the attention output"),
        (dict(gpt_j_residual=True, moe_num_experts=2), "drops the attention output"),
        # positional_embeddings.py:43,68: cos/sin are built for an even count only
        (dict(pos_emb="rotary", hidden_size=72, num_attention_heads=8), "rotates 9 of each head's 9"),
        # word_embeddings.py:88-91,143-149: max_position_embeddings rows, positions shifted by the offset
        (dict(pos_emb="learned", opt_pos_emb_offset=2), "set max_position_embeddings: 10"),
        # transformer.py:168-171: the fused bias+GeLU kernel adds the MLP's bias
        (dict(bias_gelu_fusion=True, use_bias_in_mlp=False), "cannot run without one"),
    ],
)
def test_what_gpt_neox_cannot_build_is_refused(keys: dict[str, Any], needle: str) -> None:
    config = GPTConfig(**{**dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                                 padded_vocab_size=64), **keys})
    with pytest.raises(ModelConfigError) as err:
        config.check_architecture()
    assert needle in err.value.message


def test_rotary_rotates_int_head_dim_x_rotary_pct() -> None:
    """transformer.py:383-401 and positional_embeddings.py:43: int(head_dim x rotary_pct) dims,
    inv_freq = 1 / base^(2i / dims)."""
    from megatron.model.positional import RotaryEmbedding

    config = GPTConfig(num_layers=1, hidden_size=320, num_attention_heads=4, seq_length=8, pos_emb="rotary",
                       rotary_pct=0.3, rotary_emb_base=500)
    assert config.rotary_dim == int(80 * 0.3) == 24
    inv_freq = RotaryEmbedding(config.rotary_dim, config.rotary_emb_base).inv_freq
    want = torch.tensor([1.0 / 500 ** (2 * i / 24) for i in range(12)])
    torch.testing.assert_close(inv_freq, want)


# --- norms -------------------------------------------------------------------------------------------
def test_rmsnorm_has_its_epsilon_inside_the_root_and_scales_in_fp32() -> None:
    """norms.py:86-99: x * rsqrt(mean(x^2) + eps) in fp32, times the scale, then cast."""
    from megatron.model.norm_layers import RMSNorm

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 0.3
    norm = RMSNorm(16, eps=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    inside = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 0.5) * norm.weight
    outside = x / (torch.sqrt((x**2).mean(-1, keepdim=True)) + 0.5) * norm.weight
    torch.testing.assert_close(norm(x), inside)
    assert not torch.allclose(norm(x), outside, atol=1e-3)
    # bf16: GPT-NeoX multiplies the fp32 normalised value by the scale before casting back
    norm16, x16 = norm.to(torch.bfloat16), x.to(torch.bfloat16)
    xf = x16.float()
    want = (norm16.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 0.5))).to(torch.bfloat16)
    assert torch.equal(norm16(x16), want)


def test_layernorm_bias_key_that_gpt_neox_ignores_is_said_before_launch() -> None:
    """GPT-NeoX declares use_bias_in_norms (neox_args.py:448) but no layer reads it."""
    from megatron.config_rules import RuleContext
    from megatron.model.checks import layernorm_bias_key

    ctx = RuleContext(args=NeoXArgs(norm="layernorm", use_bias_in_norms=False))
    assert layernorm_bias_key(ctx) == [] and "GPT-NeoX ignores this key" in ctx.warnings[0]
    quiet = RuleContext(args=NeoXArgs(norm="rmsnorm", use_bias_in_norms=False))
    assert layernorm_bias_key(quiet) == [] and quiet.warnings == []


# --- initialisers --------------------------------------------------------------------------------------
def test_each_weight_is_drawn_by_gpt_neoxs_initialiser() -> None:
    """init_functions.py:25-175 (std of each method) and which weights take it (gpt2_model.py,
    transformer.py): init_method for the embedding, QKV, the MLP's first projection and an untied output
    layer; output_layer_init_method for the attention output and the MLP's second projection."""
    L, h = 4, 256
    config = GPTConfig(num_layers=L, hidden_size=h, num_attention_heads=4, seq_length=8, padded_vocab_size=1024,
                       no_weight_tying=True, init_method="small_init", output_layer_init_method="wang_init",
                       pos_emb="rotary")
    model = GPTModel(config)
    small, wang = math.sqrt(2 / (5 * h)), 2 / L / math.sqrt(h)  # init_functions.py:149, 164
    stds = {name: param.std().item() for name, param in model.named_parameters() if param.dim() == 2}
    for name, std in stds.items():
        want = wang if name.endswith(("attention.dense.weight", "dense_4h_to_h.weight")) else small
        assert std == pytest.approx(want, rel=0.05), name
    from megatron.mpu.initialize_weights import init_method_from_name

    sigma = 0.02
    for method, want in [("normal", sigma), ("scaled_normal", sigma / math.sqrt(2 * L)),  # :35, :52
                         ("single_residual_scaled_normal", sigma / math.sqrt(L))]:  # :214-223
        t = torch.empty(512, 512)
        init_method_from_name(method, sigma, L, h)(t, torch.Generator().manual_seed(1))
        assert t.std().item() == pytest.approx(want, rel=0.02), method
    for method, gain in [("orthogonal", math.sqrt(2)), ("scaled_orthogonal", math.sqrt(2 / L))]:  # :98-111
        t = torch.empty(64, 64)
        init_method_from_name(method, sigma, L, h)(t, torch.Generator().manual_seed(1))
        torch.testing.assert_close(t @ t.T, gain**2 * torch.eye(64), atol=1e-4, rtol=0)


# --- the dry run states the whole model -------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "vocab"), [(1, 515), (2, 520)])
def test_dry_run_states_the_whole_model(tp: int, vocab: int) -> None:
    """Pythia-410M's shapes with the character tokenizer (512 entries) padded as GPT-NeoX pads it
    (tokenizer.py:72-86): to a multiple of make_vocab_size_divisible_by (5) x tp. The count is the
    whole model whatever the layout, beside the per-device memory estimate."""
    keys = {**NEOX_PYTHIA_410M, "tokenizer_type": "CharLevelTokenizer", "make_vocab_size_divisible_by": 5,
            "model_parallel_size": tp, "pipe_parallel_size": 2, "train_micro_batch_size_per_gpu": 1,
            "train_iters": 10, "use_dummy_dataset": True, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    resolved = finalize(ResolvedConfig(args=NeoXArgs(**keys)), 2 * tp, device=GPU)
    report = dry_run_report(RunConfig.from_resolved(resolved), launches_locally=False)
    total = hf_count("gpt_neox", vocab_size=vocab, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
    non_embedding = total - 2 * vocab * 1024  # the token table and the untied output layer
    first, second = report.splitlines()[:2]
    assert first == (f"Model: {total:,} parameters ({non_embedding:,} without embeddings), the whole model over all "
                     f"stages and tensor-parallel shards, vocabulary padded to {vocab:,} for tp={tp}")
    assert second.startswith(f"Memory estimate per device (tp={tp} pp=2 dp=1")
