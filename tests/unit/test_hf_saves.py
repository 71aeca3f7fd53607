"""Hugging Face model directories written while training (``megatron/training/hf_saves.py``): when Levanter's
``hf_save_path`` hook writes, that transformers loads what is written with our model's logits (the LoRA run's with
its adapters merged), the layouts refused by name before launch, and Levanter's keys as the dialect maps them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron.config_rules import RuleContext
from megatron.model.config import GPTConfig
from megatron.tokenizer.config import TokenizerArgs
from megatron.training.hf_save_config import HFSaveArgs, hf_save_layouts
from megatron.training.hf_saves import HFSaves, live_weights, save_due, save_dtype, step_dir

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=512, seed=3,
            pos_emb="rotary", precision="fp32")  # fmt: skip
LLAMA = dict(BASE, norm="rmsnorm", activation="swiglu", num_kv_heads=2, intermediate_size=96, no_weight_tying=True,
             use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1e-6)  # fmt: skip
CHARS = TokenizerArgs(tokenizer_type="CharLevelTokenizer")


def levanter_saves(num_train_steps: int, every: int) -> list[int]:
    """The step directories Levanter's hf_save_path hook writes, re-derived from its code (stanford-crfm/levanter
    9263f81e): ``StepInfo.step = state.step - 1`` (callbacks/_core.py:37); hooks run when ``step % every == 0``
    (trainer.py:99) and, forced, once after the last step (trainer.py:448-449); ``save_hf_checkpoint_callback``
    returns at step 0 (compat/hf_checkpoints.py:1049-1050), into ``step-<step>`` (line 1058)."""
    written = [state_step - 1 for state_step in range(1, num_train_steps + 1)
               if (state_step - 1) % every == 0 and state_step - 1 != 0]
    return written + ([num_train_steps - 1] if num_train_steps - 1 != 0 else [])


@pytest.mark.parametrize("steps, every", [(5, 2), (7, 3), (1, 1), (2, 1), (10, 5), (10000, 10000), (20001, 10000)])
def test_saves_at_levanters_steps(steps: int, every: int) -> None:
    ours = [n - 1 for n in range(1, steps + 1) if save_due(n, every, last=False)]
    ours += [steps - 1] if save_due(steps, every, last=True) else []
    assert ours == levanter_saves(steps, every)
    assert step_dir("out/hf/run-a", 501) == Path("out/hf/run-a/step-500")


def _trained_like(config: GPTConfig, lora: Any = None) -> dict[str, torch.Tensor]:
    """Our model's weights, perturbed so no tensor is at its initial value (adapters' B included)."""
    from megatron.model.gpt import GPTModel
    from megatron.model.lora import apply_lora

    model = GPTModel(config)
    if lora is not None:
        apply_lora(model, lora, config.seed)
    gen = torch.Generator().manual_seed(1)
    return {k: v.detach() + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _run(tmp_path: Path, config: GPTConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
         lora_scale: float | None = None, steps: int = 3, every: int = 2) -> HFSaves:
    from megatron.interop.hf_save_writer import HFModelWriter

    keys = HFSaveArgs(hf_save_path=str(tmp_path / "hf" / "run-a"), hf_save_interval=every)
    saves = HFSaves(keys, lambda: weights, HFModelWriter(config, CHARS, dtype, lora_scale))
    for iteration in range(1, steps + 1):
        saves.after_step(None, SimpleNamespace(iteration=iteration))
    saves.at_exit(None, SimpleNamespace(iteration=steps))
    return saves


@torch.no_grad()
def test_a_save_loads_in_transformers_with_our_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from megatron.interop.hf_model import build_gpt_model, fixed_batch

    config = GPTConfig(**LLAMA)
    weights = _trained_like(config)
    saves = _run(tmp_path, config, weights)
    step = tmp_path / "hf" / "run-a" / "step-2"
    assert saves.written == [step]  # 0-based step 2; the forced last hook finds it written (Levanter rewrites it)
    assert sorted(p.name for p in step.parent.iterdir()) == ["step-2"]  # no temporary directory left
    names = {p.name for p in step.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    hf = AutoModelForCausalLM.from_pretrained(step, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    tokens = fixed_batch(config.vocab, 24)
    ours = build_gpt_model(config, weights)(tokens)
    assert (hf(input_ids=tokens).logits - ours).abs().max() <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("levanter_targets", [False, True], ids=["fused", "every_linear_layer"])
def test_a_lora_run_saves_the_merged_model(tmp_path: Path, levanter_targets: bool) -> None:
    """lora_lm.py's merged_hf_save_path: the base with ``W + (alpha/r) B A`` in every adapted layer; with
    Levanter's ``target_modules: null`` (one adapter per q, k, v, gate, up and one on the head) too."""
    from transformers import AutoModelForCausalLM

    from megatron.interop.hf_model import fixed_batch
    from megatron.interop.lora_export import adapted_model
    from megatron.model.lora_config import LoRAArgs

    config = GPTConfig(**LLAMA)
    targets = ["query_key_value", "dense", "dense_h_to_4h"] + (["dense_4h_to_h", "output_layer"] if levanter_targets
                                                               else [])
    lora = LoRAArgs(lora_r=4, lora_alpha=8.0, lora_target_modules=targets, lora_split_fused=levanter_targets)
    weights = _trained_like(config, lora)
    _run(tmp_path, config, weights, lora_scale=lora.lora_scale, steps=2, every=1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "run-a" / "step-1", local_files_only=True).eval()
    tokens = fixed_batch(config.vocab, 24)
    ours = adapted_model(config, lora, weights)(tokens)
    assert (hf(input_ids=tokens).logits - ours).abs().max() <= 1e-4


def test_dtype_and_the_average_in_place_of_the_trained_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    assert save_dtype(HFSaveArgs(), "bfloat16") == torch.bfloat16  # None: the training precision's
    assert save_dtype(HFSaveArgs(), None) == torch.float32
    assert save_dtype(HFSaveArgs(hf_save_dtype="fp16"), "bfloat16") == torch.float16
    config = GPTConfig(**dict(LLAMA, num_layers=1))
    module = torch.nn.Module()
    module.emb = torch.nn.Linear(2, 2, bias=False)  # type: ignore[assignment]
    average = {"emb.weight": torch.full((2, 2), 7.0)}
    assert torch.equal(live_weights(module, lambda: average)()["emb.weight"], average["emb.weight"])
    weights = _trained_like(config)
    _run(tmp_path, config, weights, dtype=torch.bfloat16, steps=2, every=1)
    step = tmp_path / "hf" / "run-a" / "step-1"
    stored = load_file(str(step / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    written = json.loads((step / "config.json").read_text())
    assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"
    assert torch.equal(stored["model.norm.weight"], weights["final_norm.weight"].to(torch.bfloat16))


def test_the_last_step_is_written_after_the_loop(tmp_path: Path) -> None:
    calls: list[str] = []

    def writer(weights: Any, out_dir: Path) -> None:
        calls.append(out_dir.name)
        (out_dir / "config.json").write_text("{}")

    saves = HFSaves(HFSaveArgs(hf_save_path=str(tmp_path), hf_save_interval=2), dict, writer)
    for iteration in range(1, 5):
        saves.after_step(None, SimpleNamespace(iteration=iteration))
    saves.at_exit(None, SimpleNamespace(iteration=4))
    assert [p.name for p in saves.written] == ["step-2", "step-3"] and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def test_only_the_writer_writes(tmp_path: Path) -> None:
    saves = HFSaves(HFSaveArgs(hf_save_path=str(tmp_path), hf_save_interval=1), dict, None)
    saves.after_step(None, SimpleNamespace(iteration=2))
    saves.at_exit(None, SimpleNamespace(iteration=2))
    assert saves.written == [] and list(tmp_path.iterdir()) == []


def test_a_model_without_a_transformers_class_is_refused_before_the_first_step() -> None:
    from megatron.errors import ConversionError
    from megatron.interop.hf_save_writer import HFModelWriter

    with pytest.raises(ConversionError, match="(?s)hf_save_path .*pos_emb: alibi"):
        HFModelWriter(GPTConfig(**dict(LLAMA, pos_emb="alibi")), CHARS, torch.float32, None)


@pytest.mark.parametrize("extra, named", [
    ({"model_parallel_size": 2}, "model_parallel_size=2"),
    ({"pipe_parallel_size": 2}, "pipe_parallel_size=2"),
    ({"moe_expert_parallel_size": 2}, "moe_expert_parallel_size=2"),
    ({"train_impl": "rm"}, "train_impl='rm'"),
])  # fmt: skip
def test_layouts_where_rank_0_lacks_the_model_are_refused_by_name(extra: dict[str, Any], named: str) -> None:
    args = SimpleNamespace(**{"hf_save_path": "out", "model_parallel_size": 1, "pipe_parallel_size": 0,
                              "zero_optimization": {"stage": 1}, "zero_stage": None, "moe_expert_parallel_size": 1,
                              "train_impl": "normal", **extra})
    problems = hf_save_layouts(RuleContext(args=args, provenance={"hf_save_path": "run.yml:3"}, world_size=2))
    assert len(problems) == 1 and named in problems[0] and "hf_save_path='out' (run.yml:3)" in problems[0]
    args.zero_optimization = {"stage": 3}  # ZeRO-3: every rank gathers the partitions before rank 0 writes
    assert len(hf_save_layouts(RuleContext(args=args, provenance={}, world_size=2))) == 1
    args.hf_save_path = None
    assert hf_save_layouts(RuleContext(args=args, provenance={}, world_size=2)) == []


def test_one_pipeline_stage_holds_the_whole_model_and_is_accepted() -> None:
    """pipe_parallel_size 1 (configs/tiny.yml, GPT-NeoX's configs): one PipelineModule stage holds every layer, read
    back under GPTModel's names (the save equals the offline export: tests/e2e/test_crash_safety.py)."""
    args = SimpleNamespace(hf_save_path="out", model_parallel_size=1, pipe_parallel_size=1, moe_expert_parallel_size=1,
                           zero_optimization={"stage": 1}, zero_stage=None, train_impl="normal")
    assert hf_save_layouts(RuleContext(args=args, provenance={}, world_size=2)) == []


# ------------------------------------------------------------------- Levanter's keys (levanter_hf_save.py)
def _train_lm(tmp_path: Path, extra: str, trainer: str = "  id: run7\n") -> Any:
    from test_levanter_sft import TINY_LLAMA, _load, _tokenizer_dir, _write

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello there"}\n')
    text = f"""data:
  train_urls: ["{data}"]
  cache_dir: "{tmp_path / 'cache'}"
  tokenizer: "{_tokenizer_dir(tmp_path)}"
{TINY_LLAMA}{trainer}{extra}"""
    return _load(_write(tmp_path, text)).args


@pytest.mark.parametrize("extra, trainer, expected", [
    # train_lm.py:55-58,204-222@9263f81e: <hf_save_path>/<run id> (append_run_id_to_base_path, checkpoint.py:624),
    # every hf_save_steps (default 10000), hf_save_dtype None: the parameters' dtype (p=f32 unless mp is one dtype)
    ("hf_save_path: out\n", "  id: run7\n", ("out/run7", 10000, "fp32")),
    ("hf_save_path: out\nhf_save_steps: 50\nhf_save_dtype: bfloat16\n", "  id: run7\n", ("out/run7", 50, "bf16")),
    ("hf_save_path: out\n", "  id: run7\n  mp: bfloat16\n  checkpointer:\n    append_run_id_to_base_path: false\n",
     ("out", 10000, "bf16")),
    ("hf_save_path: out\nhf_save_dtype: float16\n", "  id: run7\n  mp: p=f32,c=bfloat16\n", ("out/run7", 10000, "fp16")),
    ("hf_save_steps: 50\nhf_save_dtype: float16\n", "", (None, 10000, None)),  # no path: nothing written
])  # fmt: skip
def test_train_lm_hf_save_keys_map(tmp_path: Path, extra: str, trainer: str, expected: tuple[Any, ...]) -> None:
    args = _train_lm(tmp_path, extra, trainer)
    assert (args.hf_save_path, args.hf_save_interval, args.hf_save_dtype) == expected


@pytest.mark.parametrize("extra, message", [
    ("hf_save_path: out\nhf_upload: me/repo\n", "hf_upload.*uploading to the Hugging Face hub is not built"),
    ("hf_save_path: out\nhf_save_dtype: bf16\n", "hf_save_dtype.*jnp.dtype"),
])
def test_train_lm_hf_save_refusals_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    from megatron.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _train_lm(tmp_path, extra)


def test_sft_hf_save_path_needs_hf_save_steps(tmp_path: Path) -> None:
    """sft.py:68-70,290-300@9263f81e: the same path rule, hf_save_steps default 0 (a hook ``every=0`` fails at
    ``info.step % 0``, trainer.py:99), and no hf_save_dtype field."""
    from test_levanter_sft import _load, _sft_yaml, _tokenizer_dir, _write

    from megatron.errors import ConfigError

    sft = _sft_yaml(tmp_path, _tokenizer_dir(tmp_path)).replace("trainer:\n", "trainer:\n  id: run7\n")
    with pytest.raises(ConfigError, match="hf_save_path.*hf_save_steps 0"):
        _load(_write(tmp_path, sft + "hf_save_path: out\n"))
    args = _load(_write(tmp_path, sft + "hf_save_path: out\nhf_save_steps: 500\n")).args
    assert (args.hf_save_path, args.hf_save_interval, args.hf_save_dtype) == ("out/run7", 500, "fp32")
    with pytest.raises(ConfigError, match="hf_save_dtype.*train_lm.py only"):
        _load(_write(tmp_path, sft + "hf_save_path: out\nhf_save_steps: 5\nhf_save_dtype: float32\n"))
    with pytest.raises(ConfigError, match="hf_upload"):
        _load(_write(tmp_path, sft + "hf_save_path: out\nhf_save_steps: 5\nhf_upload: me/repo\n"))


def test_lora_lm_merged_hf_save_path_maps(tmp_path: Path) -> None:
    """lora_lm.py:43-46,163-168@9263f81e: <merged_hf_save_path>/<run id> (always), every hf_save_steps (default
    1000, the PEFT saves' interval too); merged_hf_upload stays refused."""
    from test_levanter_sft import _load, _lora_yaml

    from megatron.errors import ConfigError

    def load(extra: str) -> Any:
        path = _lora_yaml(tmp_path, extra + "lora:\n  target_modules: [o_proj]\n")
        path.write_text(path.read_text().replace("trainer:\n", "trainer:\n  id: run7\n"))
        return _load(path).args

    args = load("merged_hf_save_path: merged\n")
    assert (args.hf_save_path, args.hf_save_interval, args.hf_save_dtype, args.lora_r) == ("merged/run7", 1000, "fp32", 8)
    args = load("merged_hf_save_path: merged\npeft_save_path: peft\nhf_save_steps: 5\n")
    assert (args.hf_save_path, args.hf_save_interval, args.lora_peft_save_interval) == ("merged/run7", 5, 5)
    with pytest.raises(ConfigError, match="merged_hf_upload.*uploading merged HF"):
        load("merged_hf_save_path: merged\nmerged_hf_upload: me/repo\n")
    with pytest.raises(ConfigError, match="hf_save_path.*merged_hf_save_path"):
        load("hf_save_path: out\n")
