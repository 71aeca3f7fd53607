"""GPT-NeoX's Mamba, RWKV and gMLP configs train through ``deepy.py``, shrunk with key=value overrides.

One short launch per family, on GPT-NeoX's own files (``tests/fixtures/neox_configs``: ``mamba/mamba-130M.yml``,
``rwkv/170M.yml``, ``gmlp_small.yml``), each in a layout the family's parity test covers in-process
(``tests/distributed/test_model_families_parallel.py``) now through the whole stack:

* Mamba at tp=2, 4 steps, saving at steps 2 and 4: the checkpoint is in GPT-NeoX's layout (``norm.scale``,
  ``mixer.A_log``); a second launch resumes at step 2 and logs the same losses (exact); the step-4
  checkpoint exports to transformers' ``MambaForCausalLM`` (parity check <= 1e-4) and Deepy's greedy
  generation from the checkpoint equals transformers' ``generate`` on the export.
* RWKV through DeepSpeed's PipelineModule with its file's activation checkpointing, 3 steps; gMLP under
  ZeRO-3, 3 steps (one rank each: their tp/pp layouts are the parallel test's).

The fused-kernel keys GPT-NeoX's Mamba file sets are switched off: this machine has neither the packages
nor a GPU (a launch here refuses them by name, ``tests/unit/test_model_families.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)
from test_resume import losses, output

REPO = Path(__file__).resolve().parents[2]
CHAR_VOCAB = 512  # CharLevelTokenizer's vocabulary: no padding rows at tp 2, so both sides choose among the same
NEOX = REPO / "tests" / "fixtures" / "neox_configs"
pytestmark = pytest.mark.slow

SHRUNK = ("num_layers=2", "hidden_size=64", "num_attention_heads=2", "seq_length=32", "max_position_embeddings=32",
          "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=1", "use_dummy_dataset=true",
          "tokenizer_type=CharLevelTokenizer", "num_workers=0", "log_interval=1", "eval_interval=1000", "eval_iters=1",
          "distributed_backend=gloo", "optimizer={type: Adam, params: {lr: 0.002, betas: [0.9, 0.95], eps: 1.0e-8}}")
MAMBA = ("attention_config=[[[mamba], 2]]", "mamba_selective_scan_fusion=false", "mamba_causal_conv_fusion=false",
         "mamba_inner_func_fusion=false", "pos_emb=none", "init_method_std=0.5",  # peaked logits: no greedy ties
         "num_gpus=2", "model_parallel_size=2", "train_iters=4", "lr_decay_iters=4")


def deepy(tmp: Path, config: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("DEEPY_DEBUG", None)
    argv = [sys.executable, str(REPO / "deepy.py"), str(REPO / "train.py"), str(NEOX / config), *SHRUNK, *overrides,
            f"master_port={free_port()}"]
    return subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def trained(tmp: Path, config: str, *overrides: str) -> dict[int, float]:
    proc = deepy(tmp, config, *overrides, "log_dir=logs")
    assert proc.returncode == 0, output(proc)[-4000:]
    curve = losses(tmp / "logs")
    assert curve and all(math.isfinite(loss) for loss in curve.values()), curve
    return curve


@pytest.fixture(scope="module")
def mamba_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("mamba")
    assert sorted(trained(tmp, "mamba/mamba-130M.yml", *MAMBA, "save=ckpt", "checkpoint_factor=2")) == [1, 2, 3, 4]
    return tmp


def test_mamba_trains_at_tp2_in_gpt_neox_layout_and_resumes_exactly(mamba_run: Path, tmp_path: Path) -> None:
    shard = torch.load(mamba_run / "ckpt" / "global_step2" / "mp_rank_01_model_states.pt", weights_only=False)
    names = set(shard["module"])
    assert {"sequential.2.norm.scale", "sequential.2.mixer.A_log", "sequential.3.mixer.in_proj.weight"} <= names
    assert tuple(shard["module"]["sequential.2.mixer.A_log"].shape) == (64, 16)  # 128 inner channels over 2 ranks
    proc = deepy(tmp_path, "mamba/mamba-130M.yml", *MAMBA, f"load={mamba_run / 'ckpt'}", "iteration=2", "log_dir=logs")
    assert proc.returncode == 0, output(proc)[-4000:]
    resumed, straight = losses(tmp_path / "logs"), losses(mamba_run / "logs")
    assert sorted(resumed) == [3, 4]
    assert all(abs(resumed[s] - straight[s]) <= 1e-6 for s in resumed), (resumed, straight)


def test_mamba_checkpoint_greedy_generation_equals_transformers(mamba_run: Path, tmp_path: Path) -> None:
    from transformers import MambaForCausalLM

    from megatron.generation.config import TextgenArgs
    from megatron.generation.decode import generate
    from megatron.generation.replica import ModelReplica
    from megatron.generation.sampling import sample_generator
    from megatron.interop.convert import export_to_hf
    from megatron.interop.deepy_checkpoint import read_checkpoint_config, read_full_checkpoint, resolve_checkpoint
    from megatron.interop.hf_model import build_gpt_model

    report = export_to_hf(mamba_run / "ckpt", tmp_path / "hf")
    assert report.architecture == "MambaForCausalLM"
    assert report.max_logit_diff is not None and report.max_logit_diff <= 1e-4
    hf: Any = MambaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ckpt = resolve_checkpoint(mamba_run / "ckpt", None)
    config, _ = read_checkpoint_config(ckpt)
    ours = build_gpt_model(config, read_full_checkpoint(ckpt).weights)  # the tp=2 shards, merged
    prompts = [[72, 101, 108, 108, 111], [32, 119], [100, 101, 101, 112, 121, 46]]
    replica = ModelReplica(ours, vocab_size=CHAR_VOCAB, hidden_size=64)
    got = generate(replica, prompts, TextgenArgs(maximum_tokens=8).sampling(), eod=0, max_length=32,
                   generators=[sample_generator(1, i) for i in range(len(prompts))])
    for prompt, row in zip(prompts, got):
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=0,
                             pad_token_id=0)[0, len(prompt):].tolist()
        until_eod = theirs[: theirs.index(0)] if 0 in theirs else theirs
        assert row.tokens == until_eod, (prompt, row.tokens, theirs)


def test_rwkv_trains_as_a_pipeline_module_with_checkpointed_layers(tmp_path: Path) -> None:
    # its file's pipe_parallel_size 1 (DeepSpeed's PipelineModule), activation checkpointing and bf16 block as
    # written (GPT-NeoX's loss-scale fields in it have no effect: left out, and said). Two stages: the parallel test
    proc = deepy(tmp_path, "rwkv/170M.yml", "attention_config=[[[rwkv], 2]]", "num_gpus=1", "train_iters=3",
                 "lr_decay_iters=3", "save=ckpt", "log_dir=logs")
    assert proc.returncode == 0, output(proc)[-4000:]
    curve = losses(tmp_path / "logs")
    assert sorted(curve) == [1, 2, 3] and all(math.isfinite(loss) for loss in curve.values()), curve
    assert "bf16.loss_scale, bf16.loss_scale_window, bf16.initial_scale_power, bf16.hysteresis, bf16.min_loss_scale" \
        in output(proc) and "have no effect" in output(proc)
    resolved = json.loads(next((tmp_path / "logs").glob("*/deepy_config.json")).read_text())
    assert resolved["deepspeed_config"]["bf16"] == {"enabled": True}  # the run is bf16, without the fields


def test_gmlp_trains_under_zero3(tmp_path: Path) -> None:
    # ZeRO-3 gathers the parameters the block reads inside its own forward (proj's corner, the dead biases)
    curve = trained(tmp_path, "gmlp_small.yml", "fp16={enabled: false}", "num_gpus=1", "train_iters=3",
                    "lr_decay_iters=3", "save=ckpt", "pipe_parallel_size=0", "zero_optimization={stage: 3}")
    assert sorted(curve) == [1, 2, 3]
