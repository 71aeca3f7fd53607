"""The memory estimator's arithmetic (the measured comparison is tests/distributed/test_memory_estimate.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from megatron.model import num_parameters
from megatron.neox_arguments import finalize
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.config_rules import Device
from megatron.neox_arguments.run_config import RunConfig
from megatron.devices import gpu_driver_present
from megatron.engine.memory import (GiB, MemoryLayout, activation_bytes, estimate, host_memory, render,
                                     stage_parameters)

BASE: dict[str, Any] = {
    "num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
    "max_position_embeddings": 256, "pos_emb": "rotary", "no_weight_tying": True,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 2,
    "train_iters": 10, "use_dummy_dataset": True, "tokenizer_type": "CharLevelTokenizer",
}  # fmt: skip
GPU = Device(cuda=True, fp16_supported=True)
REPO = Path(__file__).resolve().parents[2]


def layout(world: int = 8, vocab: int = 1024, **overrides: Any) -> MemoryLayout:
    resolved = finalize(ResolvedConfig(args=NeoXArgs(**{**BASE, **overrides})), world, device=GPU)
    return MemoryLayout.from_run(RunConfig.from_resolved(resolved), world, vocab)


def test_stage_parameters_split_the_model() -> None:
    one = layout(world=1)
    total = num_parameters(one.model)
    assert stage_parameters(one) == total
    # tp2: every matrix halves, norms and row-parallel biases stay whole
    tp2 = layout(world=2, model_parallel_size=2)
    assert total / 2 < stage_parameters(tp2) < total / 2 * 1.01
    # pp2: the larger stage holds half the layers plus the embedding (or the head)
    pp2 = layout(world=2, pipe_parallel_size=2)
    layer = (total - 2 * 1024 * 512 - 2 * 512) // 8
    assert stage_parameters(pp2) == pytest.approx(4 * layer + 1024 * 512 + 2 * 512, abs=2 * 512)


@pytest.mark.parametrize(
    ("overrides", "per_param"),
    [
        ({"precision": "fp32", "zero_optimization": {"stage": 0}}, 4 + 4 + 0 + 8),
        ({"precision": "bfloat16", "zero_optimization": {"stage": 0}}, 2 + 2 + 4 + 8),
        # a pipeline's bf16 optimizer keeps a whole fp32 gradient buffer besides the backward's bf16 ones
        ({"precision": "bfloat16", "pipe_parallel_size": 1, "zero_optimization": {"stage": 0}}, 2 + 6 + 4 + 8),
        # ZeRO-1 keeps whole gradients until the accumulation boundary (reduced after the backward)
        ({"precision": "fp32", "zero_optimization": {"stage": 1}}, 4 + 4 + (4 + 8) / 8),
        ({"precision": "bfloat16", "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "bf16"}},
         2 + 2 + (4 + 8) / 8),
        # bf16 under ZeRO accumulates in fp32 (Deepy's default): stage 1 runs DeepSpeed's bf16 optimizer
        ({"precision": "bfloat16", "zero_optimization": {"stage": 1}}, 2 + 6 + (4 + 8) / 8),
        ({"precision": "bfloat16", "zero_optimization": {"stage": 2}}, 2 + (4 + 4 + 8) / 8),
        ({"precision": "bfloat16", "zero_optimization": {"stage": 3}}, (2 + 4 + 4 + 8) / 8),
        # Levanter's mp: bfloat16 (bf16 block's master weights and optimizer states, DeepSpeed 0.19.8):
        # the master copy and Adam's two moments at 2 bytes
        ({"precision": "bfloat16", "zero_optimization": {"stage": 3}, "bf16": {
            "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
         (2 + 4 + 2 + 2 * 2) / 8),
        ({"precision": "bfloat16", "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         2 + 4 / 8),
        ({"precision": "fp32", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, 4 + 4),
        ({"precision": "fp32", "optimizer": {"type": "Lion", "params": {"lr": 0.1}}}, 4 + 4 + 4),
    ],
)
def test_model_states_by_zero_stage(overrides: dict[str, Any], per_param: float) -> None:
    lay = layout(**overrides)  # 8 ranks: dp 8
    est = estimate(lay)
    assert est.model_states == pytest.approx(per_param * est.parameters)
    if "offload_optimizer" in overrides.get("zero_optimization", {}):
        assert est.offloaded == pytest.approx((4 + 8) / 8 * est.parameters)


def test_zero_buckets_follow_deepspeeds_settings() -> None:
    assert estimate(layout(zero_optimization={"stage": 0})).zero_buckets == 0
    assert estimate(layout(precision="fp32", zero_optimization={"stage": 1})).zero_buckets == 5e8 * 4
    assert estimate(layout(precision="bfloat16", zero_optimization={
        "stage": 2, "overlap_comm": True, "reduce_bucket_size": 1e8})).zero_buckets == 2 * 1e8 * 2
    assert estimate(layout(zero_optimization={"stage": 2, "contiguous_gradients": False})).zero_buckets == 0


def test_activations_match_korthikanti_per_layer() -> None:
    # a GPT layer with dropout keeps 34·s·b·h bytes in 16 bits (Korthikanti et al. 2022, without the
    # attention scores that fused attention does not store); (10 + 24/t)·s·b·h with tensor parallelism
    kw = dict(precision="bfloat16", hidden_dropout=0.1, no_weight_tying=False, zero_optimization={"stage": 0})
    two, one = layout(world=1, num_layers=2, **kw), layout(world=1, num_layers=1, **kw)
    s, b, h = 256, 2, 512
    assert activation_bytes(two) - activation_bytes(one) == 34 * s * b * h
    tp_two = layout(world=2, num_layers=2, model_parallel_size=2, **kw)
    tp_one = layout(world=2, num_layers=1, model_parallel_size=2, **kw)
    assert activation_bytes(tp_two) - activation_bytes(tp_one) == (10 + 24 / 2) * s * b * h


def test_checkpointing_keeps_only_layer_inputs() -> None:
    full = layout(precision="bfloat16")
    ckpt = layout(precision="bfloat16", checkpoint_activations=True)
    assert ckpt.recomputed_layers == 8 and full.recomputed_layers == 0
    assert activation_bytes(ckpt) < activation_bytes(full) / 3
    every_other = layout(precision="bfloat16", selective_checkpointing=2)
    assert every_other.recomputed_layers == 4
    assert activation_bytes(ckpt) < activation_bytes(every_other) < activation_bytes(full)
    more = dataclasses.replace(full, micro_batch=4)
    assert activation_bytes(more) == pytest.approx(2 * activation_bytes(full))


def test_render_warns_when_the_device_is_too_small() -> None:
    lay = layout()
    est = estimate(lay)
    text = render(lay, est, 0.01, "device_memory_gb")
    assert "WARNING: the estimate exceeds the device's 0.0 GiB (device_memory_gb)" in text
    assert "fits in the device's 80.0 GiB" in render(lay, est, 80.0)
    assert f"{est.total / GiB:.2f} GiB" in text
    assert "WARNING" not in render(lay, est, None)


def test_checkpoint_num_layers_keeps_one_input_per_chunk() -> None:
    """Chunks of k blocks: 8/k saved chunk inputs (2·s·b·h bytes each in bf16) instead of 8, and a
    whole chunk's activations (one block's, from the difference of a 2- and a 1-block model) alive
    while it is recomputed."""
    one = layout(precision="bfloat16", checkpoint_activations=True)
    four = layout(precision="bfloat16", checkpoint_activations=True, checkpoint_num_layers=4)
    assert (one.checkpoint_chunk, four.checkpoint_chunk) == (1, 4)
    s, b, h = 256, 2, 512
    layer = activation_bytes(layout(precision="bfloat16", num_layers=2)) - activation_bytes(
        layout(precision="bfloat16", num_layers=1))
    # 8 inputs -> 2 inputs saved; 1 -> 4 blocks being recomputed at once
    assert activation_bytes(four) - activation_bytes(one) == -(8 - 2) * 2 * s * b * h + 3 * layer


# ---------------------------------------------------------------- LoRA adapters
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["query_key_value", "dense", "dense_h_to_4h",
                                                                "dense_4h_to_h"]}


EVERY_LINEAR = {"lora_r": 8, "lora_split_fused": True, "activation": "swiglu", "num_kv_heads": 2,
                "intermediate_size": 2046, "no_weight_tying": True, "lora_target_modules": [*LORA["lora_target_modules"], "output_layer"]}
"""Levanter's target_modules null on a Llama: q/k/v and gate/up split by sections (GQA) and the untied head."""


@pytest.mark.parametrize("tp, lora", [(1, LORA), (2, LORA), (1, EVERY_LINEAR)])
def test_adapter_count_is_the_real_models_trainable_parameters(tp: int, lora: dict[str, Any]) -> None:
    """Independent count: the trainable parameters of a GPTModel after apply_lora (tp 1), and at tp 2
    each factor on a layer's split side halves."""
    from megatron.model import GPTModel
    from megatron.model.lora import apply_lora
    from megatron.engine.memory import adapter_parameters

    one = layout(world=1, **lora)
    model = GPTModel(one.model)
    apply_lora(model, one.lora, seed=1)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if tp == 1:
        assert adapter_parameters(one) == real
    else:
        h, ffn, r = 512, one.model.ffn_hidden_size, 8
        split_side = 8 * r * (3 * h + h + ffn + ffn)  # B of qkv/h_to_4h rows, A of dense/4h_to_h columns
        assert adapter_parameters(layout(world=2, model_parallel_size=2, **LORA)) == real - split_side // 2


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lora_optimizer_memory_is_for_the_adapters_only(stage: int) -> None:
    from megatron.engine.memory import adapter_parameters

    full = estimate(layout(zero_optimization={"stage": stage}, precision="bfloat16"))
    lay = layout(zero_optimization={"stage": stage}, precision="bfloat16", **LORA)
    est = estimate(lay)
    t, dp = adapter_parameters(lay), 8
    div = 1 if stage == 0 else dp
    assert est.optimizer_states == pytest.approx(4 * 2 * t / div)  # Adam: 2 fp32 states per adapter element
    assert est.master_weights == pytest.approx(4 * t / div)
    # bf16 under ZeRO accumulates in fp32; ZeRO-1 (DeepSpeed's bf16 optimizer) keeps them whole
    assert est.gradients == pytest.approx({0: 2 * t, 1: 6 * t, 3: 4 * t / dp}[stage])
    # the frozen base still takes its weights (ZeRO-3 partitions them too)
    assert est.weights == pytest.approx(full.weights * (full.parameters + t) / full.parameters)
    assert est.model_states - est.weights < (full.model_states - full.weights) / 10
    text = render(lay, est, None)
    assert "trained (LoRA r=8)" in text and f"{t:,}" in text


# ---------------------------------------------------------------- terms a GPU run pays
def test_zero1_at_7b_keeps_whole_gradients() -> None:
    """The issue's figure: a 7B-shaped bf16 model at dp8 under ZeRO-1 (bf16 accumulation) holds its
    2-byte gradients whole, 2P, not 2P/8."""
    lay = layout(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                 max_position_embeddings=2048, precision="bfloat16", zero_optimization={"stage": 1},
                 data_types={"grad_accum_dtype": "bf16"})
    est = estimate(lay)
    assert est.gradients == 2 * est.parameters and est.gradients / GiB > 12


def test_rmsnorm_keeps_its_fp32_input() -> None:
    """torch's rms_norm saves the fp32 copy our RMSNorm hands it: 4 bytes per element for each of a
    layer's two norms and the final one (16-bit activations; fp32 has no copy)."""
    s, b, h = 256, 2, 512
    for precision, extra in (("bfloat16", 4), ("fp32", 0)):
        rms = activation_bytes(layout(precision=precision, norm="rmsnorm"))
        ln = activation_bytes(layout(precision=precision))
        assert rms - ln == extra * s * b * h * (2 * 8 + 1)


def test_z_loss_adds_no_logits_sized_memory() -> None:
    """log Z comes out of the chunked cross-entropy (tests/unit/test_cross_entropy.py shows nothing of
    the logits' size is kept for it), so the estimate adds nothing for z_loss."""
    assert activation_bytes(layout(z_loss=1e-4)) == activation_bytes(layout())


@pytest.mark.parametrize(("overrides", "kernel"), [
    ({}, "flash"),
    ({"precision": "fp32"}, "efficient"),
    ({"pos_emb": "alibi"}, "efficient"),
    ({"sliding_window_width": 255}, "flash"),  # seq 256: no key is further than 255 back
    ({"sliding_window_width": 64}, "efficient"),
    ({"num_kv_heads": 2, "sliding_window_width": 64}, "efficient"),  # kv heads repeated for the mask
    ({"num_kv_heads": 2, "precision": "fp32"}, "math"),  # grouped, no mask, not 16-bit: flash is out
    ({"hidden_size": 520, "rotary_pct": 0.25}, "math"),  # head dim 65 (16 of its dims rotate: an even count)
])
def test_sdpa_kernel_by_variant(overrides: dict[str, Any], kernel: str) -> None:
    from megatron.engine.memory import sdpa_kernel

    lay = layout(**{"precision": "bfloat16", **overrides})
    assert sdpa_kernel(lay.model, lay.precision, lay.seq_length) == kernel


def test_the_math_kernel_keeps_the_attention_probabilities() -> None:
    """b x heads x s x s probabilities per layer (4 bytes in fp32; with attention dropout also its
    one-byte mask and the dropped copy) where SDPA falls back to the math kernel."""
    s, b, n = 256, 2, 8
    fused = layout(precision="fp32", num_kv_heads=8)
    math_kernel = layout(precision="fp32", num_kv_heads=2)
    kv_saved = 8 * s * b * 2 * (512 - 128) * 4  # its smaller k and v, 8 layers
    assert activation_bytes(math_kernel) - activation_bytes(fused) == 8 * b * n * s * s * 4 - kv_saved
    dropped = layout(precision="fp32", num_kv_heads=2, attention_dropout=0.1)
    dropped_fused = layout(precision="fp32", num_kv_heads=8, attention_dropout=0.1)
    assert activation_bytes(dropped) - activation_bytes(dropped_fused) == 8 * b * n * s * s * (4 + 1 + 4) - kv_saved


# --- issue 42 item 14: refused before launch where the ranks of this machine cannot fit -------------
DRY_MODEL = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
optimizer: {type: Adam, params: {lr: 0.001}}
train_iters: 4
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
precision: fp32
zero_optimization: {stage: 1}
"""


def _dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    config = tmp_path / "model.yml"
    config.write_text(DRY_MODEL)
    argv = ["--dry-run", str(REPO / "train.py"), str(config), *overrides]
    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out + captured.err


def _machine_memory() -> float:
    """Bytes this machine's ranks can have, read here: MemTotal, or a container's smaller limit."""
    limits = [int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
              if line.startswith("MemTotal:")]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(path).read_text().strip() if Path(path).is_file() else ""
        limits += [int(text)] if text.isdigit() else []
    return float(min(limits))


def test_host_memory_is_the_least_of_memtotal_and_the_containers_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   22118880 kB\n")
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")  # cgroup v2 without a limit
    host = host_memory(str(meminfo), (str(limit),))
    assert host is not None and (host.total, host.available) == (24684084 * 1024, 22118880 * 1024)
    assert host.source == "MemTotal in /proc/meminfo"
    limit.write_text(f"{8 * GiB}\n")
    host = host_memory(str(meminfo), (str(limit),))
    assert host is not None and host.total == 8 * GiB and str(limit) in host.source


@pytest.mark.skipif(gpu_driver_present(), reason="the CPU ranks' shared memory is checked where there is no GPU")
def test_the_cpu_ranks_of_a_machine_share_its_memory_before_launch_unless_allow_memory_overcommit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU ranks of one machine share its memory: a micro batch one rank fits in and two do not is
    refused at 2 ranks, by name, before launch (the dry run too); allow_memory_overcommit launches anyway."""
    from megatron.app.deepy import memory_fit, parse_command, resolve

    def need(micro: int) -> float:
        command = parse_command([str(REPO / "train.py"), str(tmp_path / "model.yml"), "num_gpus=1",
                                 f"train_micro_batch_size_per_gpu={micro}"])
        return memory_fit(resolve(command)).host_need

    (tmp_path / "model.yml").write_text(DRY_MODEL)
    machine = _machine_memory()
    # the estimate grows linearly with the micro batch: pick one that takes 3/4 of the machine per rank
    slope = need(2) - need(1)
    micro = int((0.75 * machine - (need(1) - slope)) / slope)
    assert 0.7 * machine < need(micro) < 0.8 * machine
    code, out = _dry_run(tmp_path, capsys, "num_gpus=1", f"train_micro_batch_size_per_gpu={micro}")
    assert code == 0 and "fits in this machine's" in out, out
    code, out = _dry_run(tmp_path, capsys, "num_gpus=2", f"train_micro_batch_size_per_gpu={micro}")
    assert code == 2, out
    assert out.count("deepy: config error:") == 1 and "Traceback" not in out
    assert f"x 2 rank(s) on this machine = {2 * need(micro) / GiB:.2f} GiB, exceeds its {machine / GiB:.1f} GiB" in out
    assert f"the most of it is activations (train_micro_batch_size_per_gpu={micro} (command line))" in out
    assert "allow_memory_overcommit: true" in out
    code, out = _dry_run(tmp_path, capsys, "num_gpus=2", f"train_micro_batch_size_per_gpu={micro}",
                         "allow_memory_overcommit=true")
    assert code == 0 and "launching anyway (allow_memory_overcommit=True (command line))" in out, out
