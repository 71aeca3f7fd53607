"""``convert_neox_to_hf.py --adapters peft`` for every architecture the export writes (issue 49): the adapters
become PEFT LoRA modules of the exported transformers model (``megatron/interop/lora_export.py``,
``peft_adapters``), whatever its layout - GPTNeoX's fused per-head QKV, a Llama's or Qwen2's separate q/k/v and
gate/up - with or without ``lora_split_fused``.

The reference is PEFT's own loader (peft 0.21.2): ``PeftModel.from_pretrained`` on the exported base must give the
logits of our model with its adapters (the export's built-in check, max |dlogit| <= 1e-4 in fp32), and PEFT's
``merge_and_unload`` must give the weights of our ``--adapters merge`` export. The adapters are drawn non-zero
and move the logits, so a misplaced row would show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron.interop.hf_tokenizer import TokenizerFiles
from megatron.interop.lora_export import export_adapters
from megatron.model import GPTConfig, GPTModel
from megatron.model.lora import apply_lora
from megatron.model.lora_config import LoRAArgs

EVERY = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"]
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=64,
             no_weight_tying=True, pos_emb="rotary")
LLAMA = dict(SHAPE, num_kv_heads=2, norm="rmsnorm", activation="swiglu", intermediate_size=48,
             use_bias_in_attn_linear=False, use_bias_in_mlp=False)
MOE = dict(LLAMA, intermediate_size=16, moe_num_experts=4, moe_top_k=2, moe_router_type="topk",
           moe_router_renormalize=True)
GEMMA = dict(LLAMA, norm="gemma_rmsnorm", norm_placement="sandwich", activation="geglu_tanh", kv_channels=16,
             scale_embeddings_by_sqrt_hidden=True, query_pre_attn_scalar=16.0, attn_logit_softcapping=5.0,
             final_logit_softcapping=3.0, attention_config=[[["local", "global"], 1]], sliding_window_width=3)
CASES = {
    "gpt_neox": (GPTConfig(**SHAPE, norm="layernorm"), False, "GPTNeoXForCausalLM"),  # type: ignore[arg-type]
    "gpt_neox_split": (GPTConfig(**SHAPE, norm="layernorm"), True, "GPTNeoXForCausalLM"),  # type: ignore[arg-type]
    "llama_split": (GPTConfig(**LLAMA), True, "LlamaForCausalLM"),  # type: ignore[arg-type]
    # a Llama's layout with biases on q/k/v (the plain Llama's separate q/k/v and gate/up, one adapter each)
    "qwen2": (GPTConfig(**LLAMA, use_bias_in_qkv=True), False, "Qwen2ForCausalLM"),  # type: ignore[arg-type]
    # Qwen3: per-head q/k RMSNorms (no adapters), heads wider than hidden / heads
    "qwen3": (GPTConfig(**LLAMA, use_qk_layernorm=True, kv_channels=16), False,  # type: ignore[arg-type]
              "Qwen3ForCausalLM"),
    # Phi-3 (asked for; partial rotary has no Llama form): q/k/v in qkv_proj, gate/up in gate_up_proj, fused as ours
    "phi3": (GPTConfig(**LLAMA, rotary_pct=0.5), False, "Phi3ForCausalLM"),  # type: ignore[arg-type]
    # OLMo 2: norms after the sublayers only, q/k RMSNorm over the whole projections
    "olmo2": (GPTConfig(**LLAMA, norm_placement="post", use_qk_layernorm=True,  # type: ignore[arg-type]
                        qk_norm_scope="projection"), False, "Olmo2ForCausalLM"),
    # Gemma 2: (1 + w) norms around each sublayer, tanh GeGLU, scaled embeddings, capped scores and logits, a
    # local and a global layer; Gemma 3: per-head q/k norms and its own rotary base on the local layer
    "gemma2": (GPTConfig(**GEMMA), False, "Gemma2ForCausalLM"),  # type: ignore[arg-type]
    "gemma3": (GPTConfig(**{**GEMMA, "attn_logit_softcapping": None}, use_qk_layernorm=True,  # type: ignore[arg-type]
                         rope_local_base_freq=100), False, "Gemma3ForCausalLM"),
    # every MLP 4 experts (which take no adapters), top-2 renormalised; Qwen3-MoE with per-head q/k norms
    "mixtral": (GPTConfig(**MOE), False, "MixtralForCausalLM"),  # type: ignore[arg-type]
    "qwen3_moe": (GPTConfig(**MOE, use_qk_layernorm=True, kv_channels=16), False,  # type: ignore[arg-type]
                  "Qwen3MoeForCausalLM"),
}


def checkpoint_weights(config: GPTConfig, lora: LoRAArgs) -> dict[str, torch.Tensor]:
    model = GPTModel(config)
    apply_lora(model, lora, seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapter" in name or "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_peft_export_loads_in_peft_with_our_logits_and_merges_to_our_merge(case: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, split, arch = CASES[case]
    args = {"lora_r": 4, "lora_alpha": 6.0, "lora_target_modules": EVERY, "lora_split_fused": split,
            "precision": "fp32"}
    lora = LoRAArgs(**{k: v for k, v in args.items() if k != "precision"})  # type: ignore[arg-type]
    weights = checkpoint_weights(config, lora)
    files = TokenizerFiles("CharLevelTokenizer")
    hf_class = "Phi3ForCausalLM" if arch == "Phi3ForCausalLM" else None
    peft = export_adapters(tmp_path / "ckpt", config, args, weights, tmp_path / "peft", mode="peft",
                           tokenizer_files=files, hf_class=hf_class)
    assert peft.architecture == arch and peft.max_logit_diff is not None and peft.max_logit_diff <= 1e-4
    merged = export_adapters(tmp_path / "ckpt", config, args, weights, tmp_path / "merged", mode="merge",
                             tokenizer_files=files, verify=False, hf_class=hf_class)
    assert merged.architecture == arch

    adapter_config = json.loads((tmp_path / "peft" / "lora_adapter" / "adapter_config.json").read_text())
    modules = {m.rsplit(".", 1)[-1] for m in adapter_config["target_modules"]}
    want = {"GPTNeoXForCausalLM": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "lm_head"},
            "Phi3ForCausalLM": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}}.get(
        arch, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})
    if config.moe_num_experts > 1:  # Mixtral / Qwen3-MoE: LoRA adapts no expert (Deepy's MoE layer has no Linear)
        want -= {"gate_proj", "up_proj", "down_proj"}
    assert modules == want
    # split sections in one transformers module (GPTNeoX's query_key_value) carry a rank per section held
    ranks = set(adapter_config["rank_pattern"].values())
    assert ranks == ({12} if case == "gpt_neox_split" else set())

    def load(directory: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)

    unmerged = PeftModel.from_pretrained(load(tmp_path / "peft"), str(tmp_path / "peft" / "lora_adapter"))
    theirs = unmerged.merge_and_unload().state_dict()
    ours, base = load(tmp_path / "merged").state_dict(), load(tmp_path / "peft").state_dict()
    assert set(ours) == set(theirs)
    moved = 0
    for key, tensor in ours.items():
        torch.testing.assert_close(theirs[key], tensor, atol=1e-6, rtol=1e-5)
        moved += int(not torch.equal(base[key], tensor))
    assert moved == (len(want) - 1) * config.num_layers + 1  # every adapted projection moved, in every layer
