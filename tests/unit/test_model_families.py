"""Mamba, RWKV-6 and gMLP against independent references, GPT-NeoX's parameter counts and its seven configs.

* RWKV-6: the layer equals a direct per-token recurrence written here (<= 1e-5), across the scan's chunks,
  with decays strong enough that a naive log-space chunking would overflow.
* gMLP: the block equals a direct computation (an explicit sum over earlier positions), gmlp and amlp.
* Mamba: the exported model is transformers' ``MambaForCausalLM`` with the same logits (<= 1e-4), imports back
  tensor-equal, and its greedy generation equals transformers' ``generate`` (left-padded prompts included).
* GPT-NeoX's seven configs (the shape keys of ``configs/mamba/mamba-{130M,370M,790M,1.4B,2.8B}.yml``,
  ``configs/rwkv/170M.yml``, ``configs/gmlp_small.yml`` at commit ea7aefd8, stated below, not copied) dry-run
  as a Slurm launch, and Deepy's parameter count equals the count of GPT-NeoX's modules, written out from their
  shapes in ``megatron/model/mamba/mamba.py``, ``rwkv/v6/rwkv.py``, ``gmlp.py`` (the formulas below).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron.app.deepy import parse_command, render_dry_run, resolve
from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel, KVCache, flops_per_token, num_parameters
from megatron.model.scans import wkv6

VOCAB = 50304  # GPT-NeoX's GPT-2 tokenizer (50257) padded to a multiple of 128
SLURM = ["launcher=slurm", "deepspeed_slurm=true", "num_gpus=8"]


def perturbed(config: GPTConfig, scale: float = 0.3, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
    return model.eval()


# --- RWKV-6 against a direct per-token recurrence -----------------------------------------------------------
def _ln(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def rwkv_layer_by_hand(layer: torch.nn.Module, x: torch.Tensor, heads: int) -> torch.Tensor:
    """GPT-NeoX's RWKVResidualLayer (rwkv.py:100-354) one token at a time, over time: x `[b, t, h]`."""
    att, ffn = layer.att, layer.ffn
    if layer.layer_number == 0:
        x = _ln(x, layer.ln1)
    b, t, h = x.shape
    a = att.receptance.weight.shape[0]
    n = a // heads
    out = torch.empty_like(x)
    for row in range(b):
        state = torch.zeros(heads, n, n, dtype=x.dtype)
        prev_att = torch.zeros(h, dtype=x.dtype)
        prev_ffn = torch.zeros(h, dtype=x.dtype)
        for step in range(t):
            xt = x[row, step]
            u = _ln(xt, layer.ln1)
            dx = prev_att - u
            mix = torch.tanh((u + dx * att.time_maa_x.view(h)) @ att.time_maa_w1).view(5, -1)
            mw, mk, mv, mr, mg = (mix[i] @ att.time_maa_w2[i] for i in range(5))
            r = att.receptance.weight @ (u + dx * (att.time_maa_r.view(h) + mr))
            k = att.key.weight @ (u + dx * (att.time_maa_k.view(h) + mk))
            v = att.value.weight @ (u + dx * (att.time_maa_v.view(h) + mv))
            g = F.silu(att.gate.weight @ (u + dx * (att.time_maa_g.view(h) + mg)))
            xw = u + dx * (att.time_maa_w.view(h) + mw)
            w = att.time_decay.view(a) + torch.tanh(xw @ att.time_decay_w1) @ att.time_decay_w2
            decay = torch.exp(-torch.exp(w)).view(heads, n)
            r, k, v = r.view(heads, n), k.view(heads, n), v.view(heads, n)
            kv = k[:, :, None] * v[:, None, :]  # [H, N(key), N(value)]
            y = torch.einsum("hi,hij->hj", r, att.time_faaaa[:, :, None] * kv + state)
            state = decay[:, :, None] * state + kv
            y = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + att.ln_x.eps)
            y = y.reshape(a) * att.ln_x.weight + att.ln_x.bias
            xt = xt + att.output.weight @ (y * g)
            prev_att = u
            c = _ln(xt, layer.ln2)
            dc = prev_ffn - c
            kk = torch.relu(ffn.key.weight @ (c + dc * ffn.time_maa_k.view(h))) ** 2
            rr = torch.sigmoid(ffn.receptance.weight @ (c + dc * ffn.time_maa_r.view(h)))
            out[row, step] = xt + rr * (ffn.value.weight @ kk)
            prev_ffn = c
    return out


@pytest.mark.parametrize("layer_number", [0, 1])
def test_rwkv_layer_equals_a_per_token_recurrence(layer_number: int) -> None:
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=40, padded_vocab_size=64,
                       attention_config=[[["rwkv"], 2]])
    from megatron.model.rwkv import RWKVLayer

    torch.manual_seed(1)
    layer = RWKVLayer(config, layer_number).double()  # both sides in fp64: a difference is the maths, not rounding
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
        layer.att.time_decay.add_(3.0)  # decays of exp(-exp(3)) per step: strong, as trained models reach
    x = torch.randn(1, 36, 64, dtype=torch.float64)  # 36 steps: three of the scan's chunks
    with torch.no_grad():
        got = layer(x.transpose(0, 1)).transpose(0, 1)
        want = rwkv_layer_by_hand(layer, x, heads=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_wkv_scan_continues_from_a_state() -> None:
    gen = torch.Generator().manual_seed(0)
    r, k, v = (torch.randn(1, 37, 2, 8, generator=gen) for _ in range(3))
    log_w = -torch.exp(3 * torch.randn(1, 37, 2, 8, generator=gen))  # decays from ~1 down to exp(-e^9)
    u = torch.randn(2, 8, generator=gen)
    whole, last = wkv6(r, k, v, log_w, u)
    first, state = wkv6(r[:, :20], k[:, :20], v[:, :20], log_w[:, :20], u)
    second, last2 = wkv6(r[:, 20:], k[:, 20:], v[:, 20:], log_w[:, 20:], u, state)
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last2, last, atol=1e-5, rtol=1e-5)


# --- gMLP against a direct computation ---------------------------------------------------------------------
def gmlp_block_by_hand(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's GMLPBlock (gmlp.py:28-141): x `[b, s, h]`; no residual, the linears' biases not added."""
    y = F.gelu(_ln(x, block.norm) @ block.input_linear.weight.t())
    res, gate = y.chunk(2, dim=-1)
    gate = _ln(gate, block.sgu.norm)
    s = x.shape[1]
    w, bias = block.sgu.proj.weight, block.sgu.proj.bias
    mixed = torch.stack([sum(w[t, j] * gate[:, j] for j in range(t + 1)) + bias[t] for t in range(s)], dim=1)
    attn = block.sgu.attn
    if attn is not None:
        q, k, v = (y @ attn.proj_qkv.weight.t() + attn.proj_qkv.bias).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), -math.inf)
        mixed = mixed + (scores.softmax(-1) @ v) @ attn.proj_ffn.weight.t() + attn.proj_ffn.bias
    return (mixed * res) @ block.output_linear.weight.t()


@pytest.mark.parametrize("kind", ["gmlp", "amlp"])
def test_gmlp_block_equals_a_direct_computation(kind: str) -> None:
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=12, padded_vocab_size=64,
                       attention_config=[[[kind], 1]], gmlp_attn_dim=8, pos_emb="none")
    from megatron.model.gmlp import GMLPBlock

    torch.manual_seed(2)
    block = GMLPBlock(config, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))  # the never-added biases too: the block must not add them
    x = torch.randn(2, 9, 16)  # shorter than seq_length: the causal corner of proj
    with torch.no_grad():
        got = block(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(got, gmlp_block_by_hand(block, x), atol=1e-5, rtol=1e-5)
    assert {n for n, p in block.named_parameters() if not p.requires_grad} == {"input_linear.bias",
                                                                                 "output_linear.bias"}


# --- Mamba against transformers ----------------------------------------------------------------------------
MAMBA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, padded_vocab_size=64,
             attention_config=[[["mamba"], 2]], norm="rmsnorm", pos_emb="none", rms_norm_epsilon=1e-5,
             init_method_std=0.3)


@pytest.fixture(scope="module")
def mamba_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPTModel, Any]:
    from transformers import MambaForCausalLM

    from megatron.interop.hf_config import SpecialTokens, choose_architecture, hf_config_from_gpt
    from megatron.interop.hf_model import save_hf_model
    from megatron.interop.hf_weights import to_hf_state_dict

    config = GPTConfig(**MAMBA, no_weight_tying=True)
    ours = perturbed(config, scale=0.1)
    weights = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    arch = choose_architecture(config)
    assert arch == "MambaForCausalLM"
    out = tmp_path_factory.mktemp("mamba_hf")
    save_hf_model(hf_config_from_gpt(config, SpecialTokens(None, 0, None), torch.float32),
                  to_hf_state_dict(config, arch, weights), out, torch.float32)
    theirs = MambaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return ours, theirs


def test_mamba_logits_equal_transformers(mamba_export: tuple[GPTModel, Any]) -> None:
    ours, theirs = mamba_export
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))  # several scan chunks' worth
    with torch.no_grad():
        delta = (ours(tokens) - theirs(input_ids=tokens).logits).abs().max().item()
    assert delta <= 1e-4, delta


def test_mamba_imports_back_tensor_equal(mamba_export: tuple[GPTModel, Any]) -> None:
    from megatron.interop.hf_config import gpt_config_from_hf
    from megatron.interop.hf_weights import from_hf_state_dict

    ours, theirs = mamba_export
    config = gpt_config_from_hf(theirs.config, seq_length=32)
    assert num_parameters(config) == sum(p.numel() for p in ours.parameters())
    back = from_hf_state_dict(config, "MambaForCausalLM", theirs.state_dict())
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def assert_greedy_generation_equals_transformers(ours: Any, theirs: Any, vocab: int, hidden: int) -> None:
    """Deepy's batched greedy decode of three prompts of different lengths (left padding must not leak into the
    attention or the state) equals transformers' ``generate``, prompt by prompt, up to the first end-of-text."""
    from megatron.generation.config import TextgenArgs
    from megatron.generation.decode import generate
    from megatron.generation.replica import ModelReplica
    from megatron.generation.sampling import sample_generator

    prompts = [[5, 9, 3, 17, 22, 8], [11, 40], [7, 7, 30, 2]]
    replica = ModelReplica(ours, vocab_size=vocab, hidden_size=hidden)
    got = generate(replica, prompts, TextgenArgs(maximum_tokens=10).sampling(), eod=0, max_length=32,  # type: ignore[arg-type]
                   generators=[sample_generator(1, i) for i in range(3)])
    for prompt, row in zip(prompts, got):
        hf = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=0,
                             pad_token_id=0)[0, len(prompt):].tolist()
        cut = hf.index(0) if 0 in hf else len(hf)
        assert row.tokens == hf[:cut], (prompt, row.tokens, hf)


def test_mamba_greedy_generation_equals_transformers(mamba_export: tuple[GPTModel, Any]) -> None:
    ours, theirs = mamba_export
    assert_greedy_generation_equals_transformers(ours, theirs, vocab=64, hidden=32)


def test_export_refuses_what_transformers_cannot_run() -> None:
    from megatron.errors import ConversionError
    from megatron.interop.hf_config import choose_architecture

    with pytest.raises(ConversionError, match="pos_emb: learned"):
        choose_architecture(GPTConfig(**{**MAMBA, "pos_emb": "learned"}))
    with pytest.raises(ConversionError, match="rwkv layers"):
        choose_architecture(GPTConfig(**{**MAMBA, "hidden_size": 64, "attention_config": [[["rwkv"], 2]]}))


# --- recurrent decoding with left padding ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["rwkv", "gmlp", "amlp"])
def test_padded_prompts_decode_like_unpadded_ones(kind: str) -> None:
    """A left-padded row of a batch decodes as the same prompt alone (the pads never enter the state)."""
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=1, seq_length=16, padded_vocab_size=64,
                       attention_config=[[[kind], 2]], gmlp_attn_dim=8, pos_emb="rotary")
    model = perturbed(config, seed=4)
    prompt = [3, 9, 27, 4]
    padded = torch.tensor([[0, 0, 0, *prompt]])
    real = padded != 0
    real[0, 3:] = True
    mask = real[:, None, None, :].expand(1, 1, 7, 7) & torch.ones(7, 7, dtype=torch.bool).tril()
    mask = mask | torch.eye(7, dtype=torch.bool)  # as generation builds it: a pad sees itself
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(torch.tensor([prompt]))[0, -1]
        cache = KVCache()
        got = model(padded, positions, mask, cache)[0, -1]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


# --- GPT-NeoX's seven configs: shape keys, dry runs, parameter counts ------------------------------------------
# the keys of GPT-NeoX's files (commit ea7aefd8) that shape the model or select the layers' kernels
COMMON = {"seq_length": 2048, "max_position_embeddings": 2048, "num_attention_heads": 12}
MAMBA_COMMON = {**COMMON, "norm": "rmsnorm", "rms_norm_epsilon": 1.0e-5, "activation": "silu",
                "mamba_selective_scan_fusion": True, "mamba_causal_conv_fusion": True, "mamba_inner_func_fusion": True,
                "init_method": "small_init", "output_layer_init_method": "single_residual_scaled_normal",
                "pipe_parallel_size": 0, "model_parallel_size": 1, "bf16": {"enabled": True}}
NEOX_CONFIGS: dict[str, dict[str, Any]] = {
    **{f"mamba-{size}": {**MAMBA_COMMON, "num_layers": layers, "hidden_size": hidden,
                         "attention_config": [[["mamba"], layers]]}
       for size, layers, hidden in (("130M", 24, 768), ("370M", 48, 1024), ("790M", 48, 1536),
                                    ("1.4B", 48, 2048), ("2.8B", 64, 2560))},
    "rwkv-170M": {**COMMON, "seq_length": 512, "num_layers": 12, "hidden_size": 768, "norm": "rmsnorm",
                  "rms_norm_epsilon": 1.0e-5, "attention_config": [[["rwkv"], 12]], "activation": "silu",
                  "rotary_pct": 0.25, "no_weight_tying": True, "gpt_j_residual": True, "init_method": "small_init",
                  "output_layer_init_method": "wang_init", "pipe_parallel_size": 1, "model_parallel_size": 1,
                  "bf16": {"enabled": True}},
    "gmlp_small": {**COMMON, "attention_config": [[["gmlp"], "all"]], "num_layers": 12, "hidden_size": 768,
                   "gmlp_attn_dim": 64, "norm": "layernorm", "pos_emb": "none", "no_weight_tying": True,
                   "pipe_parallel_size": 1, "model_parallel_size": 1, "fp16": {"enabled": True}},
}
TRAINING = {"train_micro_batch_size_per_gpu": 4, "train_iters": 100, "lr_decay_iters": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 6.0e-4}}, "data_path": "data/enron/enron_text_document",
            "vocab_file": "data/gpt2-vocab.json", "merge_file": "data/gpt2-merges.txt",
            "tokenizer_type": "GPT2BPETokenizer"}


def gpt_neox_parameters(name: str) -> int:
    """The parameters of the model GPT-NeoX builds from these keys: the sum of its modules' shapes."""
    c = NEOX_CONFIGS[name]
    h, layers, v = c["hidden_size"], c["num_layers"], VOCAB
    embed = v * h  # EmbeddingPipe.word_embeddings, tied to the output unless no_weight_tying
    if name.startswith("mamba"):
        # mamba.py: d = 2h (expand 2), dt_rank = ceil(h/16), d_state 16, d_conv 4, no linear biases, conv bias
        d, r, n = 2 * h, math.ceil(h / 16), 16
        layer = (h  # norm: RMSNorm scale
                 + h * 2 * d  # in_proj
                 + d * 4 + d  # conv1d weight [d, 1, 4] + bias
                 + d * (r + 2 * n)  # x_proj
                 + r * d + d  # dt_proj weight + bias
                 + d * n + d  # A_log, D
                 + d * h)  # out_proj
        positions = c["max_position_embeddings"] * h  # pos_emb defaults to "learned" in GPT-NeoX
        return embed + positions + layers * layer + h  # + the final RMSNorm; head tied
    if name.startswith("rwkv"):
        # rwkv.py: dim_att = h, 12 heads of 64, ffn = int(3.5h) // 32 * 32, torch LayerNorms ln1/ln2
        a, f = h, int(3.5 * h) // 32 * 32
        time_mix = (6 * h  # time_maa_x/w/k/v/r/g [1, 1, h]
                    + h * 160 + 5 * 32 * h  # time_maa_w1 [h, 5*32], time_maa_w2 [5, 32, h]
                    + a + h * 64 + 64 * a  # time_decay, time_decay_w1, time_decay_w2
                    + a  # time_faaaa [heads, head_size]
                    + 4 * h * a + a * h  # receptance, key, value, gate; output
                    + 2 * a)  # ln_x GroupNorm
        channel_mix = 2 * h + h * f + h * h + f * h
        layer = 2 * 2 * h + time_mix + channel_mix
        positions = c["max_position_embeddings"] * h
        return embed + positions + layers * layer + h + v * h  # final RMSNorm, untied head
    # gmlp.py: ff = 4h; input_linear and output_linear with biases; sgu: LayerNorm(ff), proj [seq, seq] + bias
    ff, seq = 4 * h, c["seq_length"]
    layer = 2 * h + h * 2 * ff + 2 * ff + 2 * ff + seq * seq + seq + ff * h + h
    return embed + layers * layer + 2 * h + v * h  # final LayerNorm, untied head; pos_emb none


@pytest.mark.parametrize("name", sorted(NEOX_CONFIGS))
def test_neox_config_dry_runs_and_counts_like_gpt_neox(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump({**NEOX_CONFIGS[name], **TRAINING}))
    command = parse_command(["--dry-run", str(Path(__file__).resolve().parents[2] / "train.py"), str(path), *SLURM])
    resolved = resolve(command)
    text = render_dry_run(resolved, command)
    assert text.endswith("deepy: dry run OK, nothing launched"), text
    config = resolved.args.with_vocab(VOCAB)
    assert num_parameters(config) == gpt_neox_parameters(name)
    if name.startswith("mamba"):  # the kernels are the cluster's: warned about here, not refused
        assert any("mamba_selective_scan_fusion" in w for w in resolved.warnings), resolved.warnings


def test_fused_kernels_are_refused_by_name_on_this_machine(tmp_path: Path) -> None:
    path = tmp_path / "mamba.yml"
    training = {k: v for k, v in TRAINING.items() if k not in ("data_path", "vocab_file", "merge_file")}
    path.write_text(yaml.safe_dump({**NEOX_CONFIGS["mamba-130M"], **training, "use_dummy_dataset": True,
                                    "tokenizer_type": "CharLevelTokenizer", "bf16": {"enabled": False}}))
    command = parse_command(["--dry-run", str(Path(__file__).resolve().parents[2] / "train.py"), str(path),
                             "num_gpus=1"])
    with pytest.raises(ConfigError) as err:
        resolve(command)
    for key in ("mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion"):
        assert f"{key}=True" in err.value.message
    assert "set mamba_selective_scan_fusion: false" in err.value.message


def test_parameter_count_is_the_built_models() -> None:
    for kind, extra in (("mamba", {"mamba_use_bias_in_linears": True}), ("rwkv", {"no_weight_tying": True}),
                        ("gmlp", {}), ("amlp", {"norm": "rmsnorm"})):
        config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=16, padded_vocab_size=64,
                           attention_config=[[[kind], 2]], gmlp_attn_dim=8, **extra)
        assert num_parameters(config) == sum(p.numel() for p in GPTModel(config).parameters()), kind


def test_mamba_flops_are_gpt_neox_count_plus_the_small_weights() -> None:
    """GPT-NeoX's logging.py Mamba count (per token, forward + backward) is 3 x [d (11 n + 4 r + 1) + 6 d h + 2 d 4]
    per layer + 6 h V; Deepy's 6 N + 3 x scan also counts the norm, conv bias, dt bias, A_log and D weights."""
    config = GPTConfig(**{**MAMBA, "padded_vocab_size": VOCAB, "hidden_size": 768, "num_layers": 24, "seq_length": 2048,
                          "attention_config": [[["mamba"], 24]]})
    h, d, r, n, layers = 768, 1536, 48, 16, 24
    neox = 3 * (d * (11 * n + 4 * r + 1) + 6 * d * h + 2 * d * 4) * layers + 6 * h * VOCAB
    small = layers * (h + d + d + d * n + d) + h  # norms, conv bias, dt_proj bias, A_log, D; the final norm
    assert flops_per_token(config) == pytest.approx(neox + 6 * small, rel=1e-12)


def test_mamba_bias_keys_shape_the_layer() -> None:
    def names(**keys: Any) -> set[str]:
        config = GPTConfig(**{**MAMBA, "num_layers": 1, "attention_config": [[["mamba"], 1]], **keys})
        return {n for n, _ in GPTModel(config).named_parameters() if n.startswith("layers.0.mixer.")}

    default = names()
    assert "layers.0.mixer.conv1d.bias" in default and "layers.0.mixer.in_proj.bias" not in default
    assert names(mamba_use_bias_in_conv=False) == default - {"layers.0.mixer.conv1d.bias"}
    assert names(mamba_use_bias_in_linears=True) - default == {
        f"layers.0.mixer.{p}.bias" for p in ("in_proj", "x_proj", "out_proj")}


# --- the fused kernels (an NVIDIA GPU with the packages installed) -------------------------------------------
KERNELS = {"mamba_selective_scan_fusion": ("mamba_ssm",), "mamba_causal_conv_fusion": ("causal_conv1d",),
           "mamba_inner_func_fusion": ("mamba_ssm", "causal_conv1d"), "rwkv_wkv_fusion": ("fla",)}


@pytest.mark.parametrize("key", sorted(KERNELS))
def test_fused_path_equals_the_reference(key: str) -> None:
    """Each kernel key computes what the PyTorch path computes: logits and gradients, fp32, on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("the fused kernels are CUDA-only")
    for module in KERNELS[key]:
        pytest.importorskip(module)
    kind = "rwkv" if key.startswith("rwkv") else "mamba"
    config = GPTConfig(**{**MAMBA, "hidden_size": 64, "num_attention_heads": 1, "seq_length": 64,
                          "attention_config": [[[kind], 2]]})
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    outputs = []
    for variant in (config, config.replace(**{key: True})):
        model = GPTModel(variant).cuda().train()  # the same seed: the same weights
        logits = model(tokens)
        logits.float().square().mean().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (fused, fused_grads) = outputs
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-3)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


# --- checkpoints in GPT-NeoX's layout, the optimizer's groups --------------------------------------------------
def test_gpt_neox_layout_names_of_each_family() -> None:
    """GPT-NeoX's names for these layers' tensors (its modules' attribute names; RMSNorm's weight is ``scale``);
    the translation round-trips."""
    from megatron.checkpointing.neox import NeoxNames, plain_from_neox, plain_to_neox

    config = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=2, seq_length=8, padded_vocab_size=64,
                       attention_config=[[["mamba", "rwkv", "amlp"], 1]], norm="rmsnorm", gmlp_attn_dim=8)
    state = GPTModel(config).state_dict()
    neox = plain_to_neox(NeoxNames.from_config(config), state, tp=1)
    for name in ("sequential.2.norm.scale", "sequential.2.mixer.in_proj.weight", "sequential.2.mixer.A_log",
                 "sequential.2.mixer.dt_proj.bias", "sequential.3.ln1.weight", "sequential.3.att.time_faaaa",
                 "sequential.3.att.ln_x.bias", "sequential.3.ffn.key.weight", "sequential.4.norm.scale",
                 "sequential.4.sgu.norm.scale", "sequential.4.sgu.proj.weight", "sequential.4.sgu.attn.proj_qkv.bias",
                 "sequential.4.input_linear.bias", "sequential.6.norm.scale"):
        assert name in neox, name
    back = plain_from_neox(NeoxNames.from_config(config), neox, tp=1)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_mamba_a_log_and_d_are_not_decayed() -> None:
    from megatron.engine.optimizers import param_groups

    model = GPTModel(GPTConfig(**MAMBA))
    groups = {g["name"]: {id(p) for p in g["params"]} for g in param_groups(model, 0.1)}
    mixer = model.layers[0].mixer
    assert {id(mixer.A_log), id(mixer.D)} <= groups["no_decay"]
    assert id(mixer.x_proj.weight) in groups["decay"] and id(mixer.conv1d.weight) in groups["decay"]


def test_fms_fsdp_mamba_variant_is_refused_as_the_other_architecture_it_is() -> None:
    """fms-fsdp's only Mamba preset (config_utils.py, commit 5a296afe) is a Mamba-2 hybrid; mapping it onto
    GPT-NeoX's Mamba-1 layer would train another model, so the dialect names it and refuses."""
    from megatron.neox_arguments.dialects import split_argv
    from megatron.neox_arguments.loading import load_config

    _, parsed = split_argv(["--model_variant=mamba_9.8b", "--use_dummy_dataset=true"])
    with pytest.raises(ConfigError, match=r"mamba_9\.8b is a Mamba-2 hybrid .* not supported"):
        load_config([], (), None, parsed)


def test_memory_estimate_splits_what_tensor_parallelism_splits() -> None:
    """Per device at tp=2: RWKV layers are whole on every rank (GPT-NeoX has no tensor-parallel RWKV), a Mamba
    layer keeps its norm whole and halves the rest; only the vocabulary halves besides."""
    from megatron.engine.memory import MemoryLayout, stage_parameters

    def per_device(config: GPTConfig, tp: int) -> int:
        return stage_parameters(MemoryLayout(
            model=config, tp=tp, pp=1, dp=1, precision="fp32", zero_stage=0, offload_optimizer=False,
            contiguous_gradients=False, overlap_comm=False, reduce_bucket_size=0, optimizer_states=2, micro_batch=1,
            seq_length=8, grad_accum=1, recomputed_layers=0, sequence_parallel=False, dropout=False))

    h, v = 64, 128
    rwkv = GPTConfig(num_layers=2, hidden_size=h, num_attention_heads=2, seq_length=8, padded_vocab_size=v,
                     attention_config=[[["rwkv"], 2]])
    assert per_device(rwkv, 1) - per_device(rwkv, 2) == v * h // 2
    mamba = GPTConfig(**{**MAMBA, "hidden_size": h, "padded_vocab_size": v})
    d, r, n = 2 * h, 4, 16
    split = h * 2 * d + d * 4 + d + d * (r + 2 * n) + r * d + d + d * n + d + d * h  # all but the layer's norm
    assert per_device(mamba, 1) - per_device(mamba, 2) == v * h // 2 + 2 * split // 2
