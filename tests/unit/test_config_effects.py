"""Keys that used to be accepted and ignored now change what a run does (see test_config_honesty)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np

from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.derived import finalize
from megatron.config_rules import Device

REPO = Path(__file__).resolve().parents[2]
GPU = Device(cuda=True, fp16_supported=True)
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
            train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")


def test_loss_scaling_keys_reach_deepspeed() -> None:
    """Megatron's top-level fp16 keys end up in the fp16 block DeepSpeed's loss scaler reads."""
    fp16 = dict(BASE, precision="fp16", hysteresis=4, loss_scale_window=500, min_scale=2.0)
    ds = finalize(config_from_mapping(fp16), 1, device=GPU).deepspeed_config
    assert ds["fp16"] == {"enabled": True, "hysteresis": 4, "loss_scale_window": 500, "min_loss_scale": 2.0}
    fixed = finalize(config_from_mapping(dict(BASE, precision="fp16", dynamic_loss_scale=False, loss_scale=128.0)),
                     1, device=GPU).deepspeed_config
    assert fixed["fp16"]["loss_scale"] == 128.0
    dynamic = finalize(config_from_mapping(dict(BASE, precision="fp16", dynamic_loss_scale=True)), 1, device=GPU)
    assert dynamic.deepspeed_config["fp16"]["loss_scale"] == 0  # DeepSpeed: 0 = dynamic
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    assert parsed.float16_config.hysteresis == 4 and parsed.float16_config.loss_scale_window == 500


def test_peak_tflops_override() -> None:
    from megatron.logging.throughput import peak_tflops
    from megatron.neox_arguments.run_config import RunConfig

    override = RunConfig.from_mapping(dict(BASE, peak_theoretical_tflops=123.0)).logging.peak_theoretical_tflops
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", override) == 123.0  # what pretrain passes on
    table = RunConfig.from_mapping(BASE).logging.peak_theoretical_tflops
    assert table is None and peak_tflops("NVIDIA H100 80GB HBM3", "bf16", table) == 989.4


def test_git_hash_is_recorded() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    resolved = finalize(config_from_mapping(BASE), 1)
    assert resolved.args.git_hash == head and resolved.provenance["git_hash"] == "derived"
    labelled = finalize(config_from_mapping(dict(BASE, git_hash="my-label")), 1)
    assert labelled.args.git_hash == "my-label"
    assert resolved.to_json_dict()["args"]["git_hash"] == head  # what the ranks and checkpoints record


def test_mmap_warmup_reads_every_data_file(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from megatron.data.build import build_datasets
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.run_config import data_run
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefixes = []
    for name in ("a", "b"):
        prefix = str(tmp_path / name)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        for i in range(20):
            builder.add_item(np.arange(10) + i)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    config = dict(seq_length=8, train_batch_size=2, train_iters=2, eval_iters=0, train_data_paths=prefixes)
    with caplog.at_level(logging.INFO, logger="megatron.data.build"):
        build_datasets(data_run(NeoXArgs(**config)), None, 64)
    assert "mmap_warmup" not in caplog.text
    with caplog.at_level(logging.INFO, logger="megatron.data.build"):
        build_datasets(data_run(NeoXArgs(**config, mmap_warmup=True)), None, 64)
    for prefix in prefixes:
        assert f"mmap_warmup: read {prefix}.bin" in caplog.text
