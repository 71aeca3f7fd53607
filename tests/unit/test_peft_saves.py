"""LoRA adapters saved while training in HF PEFT's format (``megatron/training/peft_saves.py``): when Levanter's
``lora_lm.py`` saves, where, and that peft's own loader gives our adapted model's logits."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron.model.config import GPTConfig
from megatron.model.lora_config import LoRAArgs
from megatron.training.peft_config import PeftSaveArgs
from megatron.training.peft_saves import PeftSaves, save_due, step_dir

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48, padded_vocab_size=128, seed=3,
            pos_emb="rotary", precision="fp32")  # fmt: skip
NEOX = dict(BASE, norm="layernorm", activation="gelu", rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True)
LLAMA = dict(BASE, norm="rmsnorm", activation="swiglu", num_kv_heads=2, intermediate_size=96, no_weight_tying=True,
             use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1e-6)  # fmt: skip


def levanter_saves(num_train_steps: int, every: int) -> list[int]:
    """The step directories Levanter writes, re-derived from its code (stanford-crfm/levanter 9263f81e):
    ``StepInfo.step = state.step - 1`` (callbacks/_core.py:37); hooks run when ``step % every == 0``
    (trainer.py:97-100) and, forced, after the last step (trainer.py:448-449); the PEFT callback returns at step 0
    (lora.py:384-387)."""
    written = []
    for state_step in range(1, num_train_steps + 1):
        step = state_step - 1
        if step % every == 0 and step != 0:
            written.append(step)
    if num_train_steps - 1 != 0:
        written.append(num_train_steps - 1)
    return written


@pytest.mark.parametrize("steps, every", [(5, 2), (7, 3), (1, 1), (2, 1), (1000, 1000), (2001, 1000)])
def test_saves_at_levanters_steps(steps: int, every: int) -> None:
    ours = [n - 1 for n in range(1, steps + 1) if save_due(n, every, last=False)]
    ours += [steps - 1] if save_due(steps, every, last=True) else []
    assert ours == levanter_saves(steps, every)
    assert step_dir("out/peft/run-a", 1001) == Path("out/peft/run-a/step-1000")  # lora_lm.py:152, lora.py:400


def _adapted_weights(config: GPTConfig, lora: LoRAArgs) -> dict[str, torch.Tensor]:
    """Our model's weights with adapters whose B is not zero (a fresh adapter changes nothing)."""
    from megatron.model.gpt import GPTModel
    from megatron.model.lora import apply_lora, is_adapter_name

    model = GPTModel(config)
    apply_lora(model, lora, config.seed)
    gen = torch.Generator().manual_seed(1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key in state:
        if is_adapter_name(key):
            state[key] = torch.randn(state[key].shape, generator=gen) * 0.3
    return state


ALL = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"]


@pytest.mark.parametrize("names, shape, targets", [
    # every Linear of a Llama, as Levanter's target_modules null: q/k/v and gate/up split by sections (each its
    # own PEFT q_proj, k_proj, v_proj, gate_proj, up_proj adapter, GQA's narrower k/v) and the untied lm_head
    ("llama", LLAMA, ALL),
    ("gpt_neox", NEOX, ALL),  # the head is lm_head
])  # fmt: skip
def test_saved_adapter_loads_in_peft_with_our_logits(tmp_path: Path, names: str, shape: dict[str, Any],
                                                     targets: list[str]) -> None:
    from megatron.interop.hf_config import SpecialTokens, choose_architecture, hf_config_from_gpt
    from megatron.interop.hf_model import fixed_batch, load_hf_model, max_logit_difference, save_hf_model
    from megatron.interop.hf_weights import to_hf_state_dict
    from megatron.interop.lora_export import adapted_model, load_peft_model
    from megatron.model.lora import is_adapter_name

    config = GPTConfig(**shape)
    lora = LoRAArgs(lora_r=4, lora_alpha=8.0, lora_target_modules=targets, lora_split_fused=names == "llama")
    weights = _adapted_weights(config, lora)
    base_dir = tmp_path / "base"  # the transformers model the adapters go on, built here (nothing downloaded)
    arch = choose_architecture(config)
    save_hf_model(hf_config_from_gpt(config, SpecialTokens(0, 0, None), torch.float32),
                  to_hf_state_dict(config, arch, {k: v for k, v in weights.items() if not is_adapter_name(k)}),
                  base_dir, torch.float32)
    keys = PeftSaveArgs(lora_peft_save_path=str(tmp_path / "peft" / "run-a"), lora_peft_save_interval=2, lora_peft_names=names)
    saves = PeftSaves(keys, lora, config, weights=lambda: weights,
                      base_model=str(base_dir), writer=True)
    for iteration in (1, 2, 3):
        saves.after_step(None, SimpleNamespace(iteration=iteration))
    saves.at_exit(None, SimpleNamespace(iteration=3))
    adapter = tmp_path / "peft" / "run-a" / "step-2"
    # 0-based step 2, and the last step: Levanter's forced hook writes it again (the same weights), here once
    assert saves.written == [adapter]
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["step-2"]  # no temporary directory left
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, 8.0, "LORA")
    if names == "llama":
        assert written["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj", "lm_head"]

    tokens = fixed_batch(128, 32)
    ours = adapted_model(config, lora, weights)
    peft = load_peft_model(base_dir, adapter)
    assert max_logit_difference(ours, peft, tokens) <= 1e-4
    # the adapters matter: the base alone is far from our adapted model
    assert max_logit_difference(ours, load_hf_model(base_dir, torch.float32), tokens) > 1e-2
    # the export's merge (convert_neox_to_hf.py --adapters merge): W + scale B A, per section for split adapters,
    # read by transformers, gives the same logits
    from megatron.interop.lora_export import fused_sections
    from megatron.model.lora import merge_adapters

    merged = merge_adapters(weights, lora.lora_scale, fused_sections(config))
    save_hf_model(hf_config_from_gpt(config, SpecialTokens(0, 0, None), torch.float32),
                  to_hf_state_dict(config, arch, merged), tmp_path / "merged", torch.float32)
    merged_hf = load_hf_model(tmp_path / "merged", torch.float32)
    # W + scale B A is rounded to fp32 once per weight (~5e-7 here), which these large random adapters carry to
    # ~2e-4 in logits of magnitude ~14; a misplaced section or head row moves them by O(1)
    assert max_logit_difference(ours, merged_hf, tokens) <= 1e-3


def test_only_the_writer_writes(tmp_path: Path) -> None:
    """...but every rank asks for the weights at a save: under ZeRO-3 that is a gather every rank takes part in."""
    keys = PeftSaveArgs(lora_peft_save_path=str(tmp_path), lora_peft_save_interval=1)
    asked: list[int] = []
    saves = PeftSaves(keys, LoRAArgs(lora_r=2), GPTConfig(**BASE), weights=lambda: asked.append(1) or {},
                      base_model=None, writer=False)
    saves.after_step(None, SimpleNamespace(iteration=2))
    assert saves.written == [] and list(tmp_path.iterdir()) == []
    assert asked == [1]


@pytest.mark.parametrize("changes, world, message", [
    ({"lora_r": 0}, 1, "lora_peft_save_path='out' .* without adapters"),
    ({"model_parallel_size": 2}, 2, "lora_peft_save_path='out' .* with model_parallel_size=2"),
    ({"pipe_parallel_size": 2}, 2, "lora_peft_save_path='out' .* with pipe_parallel_size=2"),
    ({"lora_peft_names": "llama"}, 1, r"lora_target_modules=.* with lora_peft_names='llama' .*: \['query_key_value'\]"),
])  # fmt: skip
def test_layouts_without_the_whole_adapters_on_rank0_are_refused_by_name(changes: dict[str, Any], world: int,
                                                                        message: str) -> None:
    from megatron.config_rules import Device
    from megatron.errors import ConfigError
    from megatron.neox_arguments import config_from_mapping
    from megatron.neox_arguments.derived import finalize

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
                train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
                lora_r=4, lora_peft_save_path="out")
    device = Device(cuda=False, fp16_supported=False)
    finalize(config_from_mapping(base), 1, device=device)  # tp 1, pp 0, ZeRO 0, gpt_neox names: accepted
    finalize(config_from_mapping({**base, "zero_optimization": {"stage": 3}}), 1, device=device)  # gathered first
    finalize(config_from_mapping({**base, "pipe_parallel_size": 1}), 1, device=device)  # one stage: every layer
    with pytest.raises(ConfigError, match=message):
        finalize(config_from_mapping({**base, **changes}), world, device=device)


@pytest.fixture
def one_stage() -> Any:
    """This process as a one-rank world with a pipeline of one stage (pipe_parallel_size 1)."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    yield mpu.initialize_model_parallel(1, 1)
    mpu.destroy_model_parallel()


@pytest.mark.parametrize("tied", [True, False])
def test_a_one_stage_pipeline_saves_what_the_plain_model_saves(tmp_path: Path, one_stage: Any, tied: bool) -> None:
    """pipe_parallel_size 1 (configs/tiny.yml, GPT-NeoX's configs): DeepSpeed's PipelineModule names its layers by
    spec index (``2.attention...``, ``tied_modules.embed...``); the saves read them back as GPTModel's. Reference:
    GPTModel built directly (the seeded initialisation does not depend on the layout), adapters alike; the PEFT
    save of each holds the same tensors under the same names, and so does the HF model save."""
    from deepspeed.pipe import PipelineModule
    from safetensors.torch import load_file

    from megatron.interop.hf_save_writer import HFModelWriter
    from megatron.model.gpt import GPTModel
    from megatron.model.lora import apply_lora
    from megatron.model.pipeline import model_parameter_name, pipeline_layer_specs
    from megatron.tokenizer.config import TokenizerArgs
    from megatron.training.hf_save_config import HFSaveArgs
    from megatron.training.hf_saves import HFSaves, live_weights

    config = GPTConfig(**dict(NEOX, no_weight_tying=not tied))
    lora = LoRAArgs(lora_r=2, lora_target_modules=["query_key_value", "dense", "dense_4h_to_h"])
    piped = PipelineModule(layers=pipeline_layer_specs(config), loss_fn=None, topology=one_stage)
    plain = GPTModel(config)
    for module in (piped, plain):
        apply_lora(module, lora, config.seed)
    assert any(name.startswith("2.attention") for name in piped.state_dict())  # its names are the pipeline's
    for name, module in (("piped", piped), ("plain", plain)):
        weights = live_weights(module, None, rename=model_parameter_name if module is piped else None)
        keys = PeftSaveArgs(lora_peft_save_path=str(tmp_path / name / "peft"), lora_peft_save_interval=1)
        PeftSaves(keys, lora, config, weights=weights, base_model=None, writer=True).after_step(
            None, SimpleNamespace(iteration=2))
        writer = HFModelWriter(config, TokenizerArgs(tokenizer_type="CharLevelTokenizer"), torch.float32,
                               lora.lora_scale)
        HFSaves(HFSaveArgs(hf_save_path=str(tmp_path / name / "hf"), hf_save_interval=1), weights, writer).after_step(
            None, SimpleNamespace(iteration=2))
    for save in ("peft/step-1/adapter_model.safetensors", "hf/step-1/model.safetensors"):
        got, want = load_file(str(tmp_path / "piped" / save)), load_file(str(tmp_path / "plain" / save))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), save
