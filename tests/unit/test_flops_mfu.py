"""FLOPs per token, MFU/HFU and the device table, against hand computations.

The two architectures are the shipped GPT-NeoX 125M (biases, LayerNorm, GELU MLP, untied output)
and Mistral 7B (Llama-style: RMSNorm, no biases, SwiGLU, grouped-query attention 32/8). The
expected numbers are written out term by term below, not computed by the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron.logging.throughput import DEVICE_PEAKS, as_metrics, measure, peak_tflops
from megatron.model import GPTConfig, flops_per_token, num_parameters
from megatron.model.flops import hardware_flops_per_token
from megatron.neox_arguments.arguments import NeoXArgs

REPO = Path(__file__).resolve().parents[2]


def shipped(name: str, vocab: int) -> GPTConfig:
    raw = yaml.safe_load((REPO / "configs" / name).read_text())
    args = NeoXArgs(**{k.replace("-", "_"): v for k, v in raw.items()})
    return args.with_vocab(vocab)  # the arguments are the model config


def test_gpt_neox_125m_by_hand() -> None:
    c = shipped("125M.yml", vocab=50304)  # GPT-2's 50257 tokens padded to a multiple of 128
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length) == (12, 768, 12, 2048)
    assert c.no_weight_tying and c.activation == "gelu" and c.norm == "layernorm"
    h, L, s, v = 768, 12, 2048, 50304
    qkv = h * 3 * h + 3 * h  # 1,771,776
    dense = h * h + h  # 590,592
    mlp = h * 4 * h + 4 * h + 4 * h * h + h  # 4,722,432
    norms = 2 * 2 * h  # two LayerNorms with bias: 3,072
    layer = qkv + dense + mlp + norms
    assert layer == 7_087_872  # 12h^2 + 13h
    n_matmul = L * layer + 2 * h + v * h  # layers, final norm, untied output projection
    assert n_matmul == 123_689_472
    attention = 12 * L * s * h  # score and value products, forward + backward
    assert attention == 226_492_416
    assert flops_per_token(c) == 6 * n_matmul + attention == 968_629_248
    # the embedding table (v*h) does no matmul: counted in the parameters, not in the FLOPs
    assert num_parameters(c) == n_matmul + v * h


def test_mistral_7b_gqa_swiglu_by_hand() -> None:
    c = shipped("mistral/7B.yml", vocab=32000)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.kv_heads) == (32, 4096, 32, 8)
    assert (c.ffn_hidden_size, c.seq_length, c.activation, c.norm) == (14336, 4096, "swiglu", "rmsnorm")
    h, L, s, v, kv_width, ffn = 4096, 32, 4096, 32000, 8 * 128, 14336
    q, kv, o = h * h, 2 * h * kv_width, h * h  # GQA: k and v are 8 heads of 128
    mlp = 3 * h * ffn  # gate, up, down; no biases
    norms = 2 * h
    layer = q + kv + o + mlp + norms
    assert layer == 218_112_000
    n_matmul = L * layer + h + v * h
    assert n_matmul == 7_110_660_096  # 7.24B with the 131M embedding table
    # every one of the 32 query heads scores every position: GQA does not shrink this term
    attention = 12 * L * s * (32 * 128)
    assert flops_per_token(c) == 6 * n_matmul + attention == 49_106_411_520


def test_hfu_adds_one_forward_per_recomputed_layer() -> None:
    c = shipped("125M.yml", vocab=50304)
    layer_forward = 2 * 7_087_872 + 4 * 2048 * 768
    assert hardware_flops_per_token(c, 0) == flops_per_token(c)
    assert hardware_flops_per_token(c, 12) == flops_per_token(c) + 12 * layer_forward
    t = measure(tokens_per_iter=1000, iterations=1, seconds=1.0, flops_per_token=flops_per_token(c), world_size=1,
                peak=989.4, hardware_flops_per_token=hardware_flops_per_token(c, 12))
    assert t.hfu is not None and t.mfu is not None and t.hfu > t.mfu
    row = as_metrics(t)
    assert row["throughput/hfu"] == pytest.approx(row["throughput/mfu"] * hardware_flops_per_token(c, 12)
                                                  / flops_per_token(c))


def test_mfu_of_a_measured_window() -> None:
    c = shipped("125M.yml", vocab=50304)
    # 8 H100s, a global batch of 256 x 2048 tokens per step, 10 steps in 20 s
    t = measure(tokens_per_iter=256 * 2048, iterations=10, seconds=20.0, flops_per_token=flops_per_token(c),
                world_size=8, peak=peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), samples_per_iter=256)
    per_device = 256 * 2048 * 10 / 20.0 / 8  # 32,768 tokens/s per device
    assert t.tokens_per_sec_per_device == pytest.approx(per_device)
    assert t.samples_per_sec == pytest.approx(128.0)
    assert t.tflops_per_device == pytest.approx(per_device * 968_629_248 / 1e12)  # 31.74 TFLOP/s
    assert t.mfu == pytest.approx(per_device * 968_629_248 / 1e12 / 989.4)  # 3.2%


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores: no made-up peak
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("Some Future Accelerator", "bf16", None),
        (None, "fp32", None),  # CPU
    ],
)
def test_device_table(name: str | None, precision: str, peak: float | None) -> None:
    assert peak_tflops(name, precision) == peak


def test_peak_override_beats_the_table() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", override=800.0) == 800.0
    assert peak_tflops(None, "fp32", override=1.5) == 1.5  # e.g. a CPU's measured matmul peak
    t = measure(tokens_per_iter=100, iterations=1, seconds=1.0, flops_per_token=1e12, world_size=1,
                peak=peak_tflops(None, "fp32", override=200.0))
    assert t.mfu == pytest.approx(0.5)
    assert all(set(v) <= {"bf16", "fp16", "fp32"} for v in DEVICE_PEAKS.values())
